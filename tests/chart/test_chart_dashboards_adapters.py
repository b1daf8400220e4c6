"""The LoRA adapter panels: promtool evaluates their queries over known series, and the adapters
table is a Grafana table of the latest sample of each replica."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml
from corral_cli.chartgen.dashboards import DASHBOARDS
from corral_cli.chartgen.queries import dashboard_queries, metric_names
from corral_engine import wire
from corral_gateway import metrics as gw

from tests.chart.conftest import CHART

FLEET, DEPLOYMENT = "corral-fleet.json", "corral-deployment.json"
TABLE = "Adapters per replica"
CHANGED_S = 1_700_000_000  # the Unix time vllm:lora_requests_info carries as its value


def _promtool_test(
    promtool: str, tmp_path: Path, series: dict[str, str], expected: dict[str, dict[str, float]]
) -> None:
    """Each query (by dashboard, panel) of model `m` evaluated at 10m gives exactly `expected`."""
    exprs = {(q.dashboard, q.panel): q.expr for q in dashboard_queries(model="m", rate_interval="5m")}
    tests = [
        {
            "expr": exprs[tuple(key.split(": ", 1))],
            "eval_time": "10m",
            "exp_samples": [{"labels": labels, "value": v} for labels, v in samples.items()],
        }
        for key, samples in expected.items()
    ]
    unit: dict[str, Any] = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "adapters_test.yaml"
    path.write_text(yaml.safe_dump(unit))
    result = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_adapters_table_lists_each_replica_of_the_model(promtool: str, tmp_path: Path) -> None:
    """Replicas a and b serve model m with LoRA on, c serves n, d serves m without LoRA: the table
    has a row for a and b, an empty adapter list reads `none`, the value is the change in ms."""
    info = (
        wire.LORA_REQUESTS_INFO
        + '{{job="engines",instance="{}",max_lora="2",'
        + (wire.LORA_RUNNING_LABEL + '="{}",' + wire.LORA_WAITING_LABEL + '="{}"}}')
    )
    running = wire.NUM_REQUESTS_RUNNING + '{{job="engines",instance="{}",model_name="{}",engine="0"}}'
    series = {
        info.format("a", "sql,chat", ""): f"{CHANGED_S}x10",
        info.format("b", "", "sql"): f"{CHANGED_S}x10",
        info.format("c", "sql", ""): f"{CHANGED_S}x10",
        running.format("a", "m"): "1x10",
        running.format("b", "m"): "0x10",
        running.format("c", "n"): "1x10",
        running.format("d", "m"): "1x10",
    }
    row = 'instance="{}",max_lora="2",running_lora_adapters="{}",waiting_lora_adapters="{}"'
    expected = {
        f"{DEPLOYMENT}: {TABLE}": {
            "{" + row.format("a", "sql,chat", "none") + "}": CHANGED_S * 1000.0,
            "{" + row.format("b", "none", "sql") + "}": CHANGED_S * 1000.0,
        }
    }
    _promtool_test(promtool, tmp_path, series, expected)


def test_adapter_routing_panels_compute_rates_and_the_active_share(promtool: str, tmp_path: Path) -> None:
    """Model m's adapter requests: 3 a minute to an active replica, 1 to a free slot, none to a
    full one; model n's, 1 active and 1 full (filtered out where the model is chosen)."""
    routes = gw.ADAPTER_ROUTES_TOTAL + '{{job="gateway",instance="g",model="{}",affinity="{}"}}'
    series = {
        routes.format("m", "active"): "0+3x10",
        routes.format("m", "free_slot"): "0+1x10",
        routes.format("m", "full"): "0+0x10",
        routes.format("n", "active"): "0+1x10",
        routes.format("n", "full"): "0+1x10",
    }
    share = "Adapter requests finding their adapter active"
    expected = {
        f"{DEPLOYMENT}: Adapter requests/s by affinity": {
            '{affinity="active"}': 3 / 60,
            '{affinity="free_slot"}': 1 / 60,
            '{affinity="full"}': 0.0,
        },
        f"{DEPLOYMENT}: {share}": {'{model="m"}': 0.75},
        f"{FLEET}: {share}": {'{model="m"}': 0.75},
        f"{FLEET}: Adapter requests/s by model": {'{model="m"}': 4 / 60},
    }
    _promtool_test(promtool, tmp_path, series, expected)


def test_adapter_routing_panels_read_zero_and_no_share_before_any_adapter_request(
    promtool: str, tmp_path: Path
) -> None:
    """The gateway's zero series of a pool serving adapters: the rates read 0 and the share has
    no value (its panel says why), not NaN."""
    routes = gw.ADAPTER_ROUTES_TOTAL + '{{job="gateway",instance="g",model="m",affinity="{}"}}'
    series = {routes.format(tier): "0x10" for tier in gw.AFFINITY_LABELS}
    share = "Adapter requests finding their adapter active"
    expected = {
        f"{DEPLOYMENT}: Adapter requests/s by affinity": {
            f'{{affinity="{t}"}}': 0.0 for t in gw.AFFINITY_LABELS
        },
        f"{DEPLOYMENT}: {share}": {},
        f"{FLEET}: {share}": {},
    }
    _promtool_test(promtool, tmp_path, series, expected)


def test_adapter_panels_query_the_lora_metrics_and_say_when_lora_is_off() -> None:
    """Each dashboard has LoRA panels; they have no series without LoRA, so they are event-driven
    (promcheck does not fail a fleet without adapters) and say why instead of "No data"."""
    panels = {
        (name, p.title): p
        for name, build in DASHBOARDS.items()
        for p in build().panels()
        if {wire.LORA_REQUESTS_INFO, gw.ADAPTER_ROUTES_TOTAL}
        & set().union(*(metric_names(t.expr) for t in p.targets))
    }
    assert {name for name, _ in panels} == {FLEET, DEPLOYMENT}
    assert (DEPLOYMENT, TABLE) in panels
    for panel in panels.values():
        assert panel.is_event_driven and panel.no_value, panel.title


def test_adapters_table_is_an_instant_table_without_the_sample_time() -> None:
    board = json.loads((CHART / "dashboards" / DEPLOYMENT).read_text())
    table = next(p for p in board["panels"] if p["title"] == TABLE)
    assert table["type"] == "table"
    assert table["fieldConfig"]["defaults"]["noValue"].startswith("No LoRA")
    assert table["fieldConfig"]["defaults"]["unit"] == "dateTimeFromNow"  # the value is a time in ms
    (target,) = table["targets"]
    assert target["format"] == "table" and target["instant"] is True and target["range"] is False
    (organize,) = table["transformations"]
    assert organize["id"] == "organize"
    assert organize["options"]["excludeByName"] == {"Time": True}
    renamed = organize["options"]["renameByName"]
    assert [renamed[k] for k in sorted(renamed, key=organize["options"]["indexByName"].get)] == [
        "Replica",
        "Max adapters",
        "Running",
        "Waiting",
        "Changed",
    ]
    others = [p for p in board["panels"] if p["type"] == "timeseries"]
    assert others and all(t["range"] is True and "instant" not in t for p in others for t in p["targets"])
