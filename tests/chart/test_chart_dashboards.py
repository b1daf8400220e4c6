"""Dashboards: every query parses with promtool, names only declared metrics, and the JSON is sane."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from corral_cli.chartgen.dashboards import DASHBOARDS
from corral_cli.chartgen.queries import Query, dashboard_queries, declared_metric_names, metric_names
from corral_engine import wire

from tests.chart.conftest import CHART, ROOT


def _check_rules(promtool: str, exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """promtool parses each expression offline as a recording rule's `expr`."""
    rules = [{"record": f"corral:dashboard_query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "corral-dashboards", "rules": rules}]}))
    return subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def test_every_query_parses_with_promtool(promtool: str, tmp_path: Path) -> None:
    all_queries = dashboard_queries() + dashboard_queries(model="tiny-llama", rate_interval="15s")
    result = _check_rules(promtool, [q.expr for q in all_queries], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(all_queries)} rules found" in result.stdout


def test_promtool_check_catches_a_broken_query(promtool: str, tmp_path: Path) -> None:
    broken = "sum by (model) (rate(corral_gateway_requests_total[1m])"
    result = _check_rules(promtool, [broken], tmp_path)
    assert result.returncode != 0
    assert "parse error" in (result.stdout + result.stderr).lower()


def test_every_metric_is_declared_by_the_engine_or_the_gateway() -> None:
    declared = declared_metric_names()
    used: set[str] = set()
    for q in dashboard_queries():
        names = metric_names(q.expr)
        assert names, f"{q.panel}: no Corral or vLLM metric in {q.expr}"
        assert names <= declared, f"{q.panel}: undeclared {names - declared}"
        used |= names
    # The overview covers what the issue lists; these must never silently drop out.
    assert {
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "corral_gateway_requests_total",
        "corral_gateway_queue_length",
        "corral_gateway_retries_total",
        "corral_gateway_ejections_total",
    } <= used


def test_metric_names_strips_histogram_suffixes_and_ignores_labels() -> None:
    bucket = 'vllm:time_to_first_token_seconds_bucket{model_name=~"x"}'
    expr = f"histogram_quantile(0.9, sum by (le) (rate({bucket}[1m])))"
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds"}
    assert metric_names('x{job="corral_gateway_fake_total"}') == set()


def test_variables_are_filled_in() -> None:
    for q in dashboard_queries(model="tiny-llama"):
        assert "$" not in q.expr, q


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_json_is_well_formed(name: str) -> None:
    board = json.loads((CHART / "dashboards" / name).read_text())
    assert board["uid"] and board["title"].startswith("Corral")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["model"]["query"]["query"] == DASHBOARDS[name]().variables[0].query
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        area = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
            assert panel["datasource"]["uid"] == "${datasource}"


def test_drilldown_has_per_replica_panels() -> None:
    drill = [q for q in dashboard_queries() if q.dashboard == "corral-deployment.json"]
    per_replica = [q for q in drill if "instance" in q.expr or "replica" in q.expr]
    assert len(per_replica) >= 8
    assert all(isinstance(q, Query) for q in drill)


def test_speculative_acceptance_panels_compute_what_vllm_defines(promtool: str, tmp_path: Path) -> None:
    """promtool evaluates the two panels over counters growing by known amounts: model m's two
    replicas verify 4 + 4 drafts a minute and accept 12 tokens, 6 at position 0 and 4 at position 1."""
    by_panel = {q.panel: q.expr for q in dashboard_queries(rate_interval="5m")}
    labels = 'model_name="{}",engine="0",instance="{}"'
    series = {
        f"vllm:spec_decode_num_drafts_total{{{labels.format('m', 'a')}}}": 4,
        f"vllm:spec_decode_num_drafts_total{{{labels.format('m', 'b')}}}": 4,
        f"vllm:spec_decode_num_drafts_total{{{labels.format('n', 'c')}}}": 4,
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels.format('m', 'a')}}}": 12,
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels.format('n', 'c')}}}": 2,
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels.format("m", "a")},position="0"}}': 6,
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels.format("m", "a")},position="1"}}': 4,
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels.format("n", "c")},position="0"}}': 2,
    }
    expected = {
        "Mean acceptance length": {'{model_name="m"}': 2.5, '{model_name="n"}': 1.5},
        "Acceptance rate by draft position": {
            '{model_name="m",position="0"}': 0.75,
            '{model_name="m",position="1"}': 0.5,
            '{model_name="n",position="0"}': 0.5,
        },
    }
    tests = [
        {
            "expr": by_panel[panel],
            "eval_time": "10m",
            "exp_samples": [{"labels": k, "value": v} for k, v in samples.items()],
        }
        for panel, samples in expected.items()
    ]
    unit = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": f"0+{n}x10"} for s, n in series.items()],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "acceptance_test.yaml"
    path.write_text(yaml.safe_dump(unit))
    result = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_speculative_rate_panels_name_what_they_count() -> None:
    """vLLM tells drafts (one per sequence per verify step) from draft tokens (up to k each): a panel
    plotting draft tokens a second says tokens, and one titled drafts a second plots drafts."""
    draft_tokens, drafts = wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL, wire.SPEC_DECODE_NUM_DRAFTS_TOTAL
    panels = [p for build in DASHBOARDS.values() for p in build().panels()]
    plain_rates = [p for p in panels if any(" / " not in t.expr for t in p.targets)]
    counted = [p for p in plain_rates if any(draft_tokens in metric_names(t.expr) for t in p.targets)]
    assert counted, "no panel plots draft tokens a second"
    for panel in counted:
        assert "draft tokens" in panel.title.lower(), panel.title
    for panel in panels:
        if "drafts/s" in panel.title.lower():
            assert all(drafts in metric_names(t.expr) for t in panel.targets), panel.title


def test_docs_sample_counts_every_query() -> None:
    """docs/dashboards.md's sample of `promcheck check` ends with the count of every dashboard query."""
    text = (ROOT / "docs" / "dashboards.md").read_text()
    counts = re.findall(r"(\d+) of (\d+) queries returned data", text)
    assert counts, "docs/dashboards.md has no promcheck summary line"
    num_queries = len(dashboard_queries())
    num_event_driven = sum(q.is_event_driven for q in dashboard_queries())
    for with_data, total in counts:
        assert int(total) == num_queries
        assert num_queries - num_event_driven <= int(with_data) <= num_queries
