"""The dashboards' PromQL as plain queries: Grafana variables filled in, metric names pulled out.

Tests use it to parse every expression with promtool, to check each metric is one the engine or the
gateway declares, and to run every panel against a live Prometheus; docs/dashboards.md shows a user
how to do the same with `python -m corral_cli.chartgen.promcheck`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType

from corral_engine import wire
from corral_gateway import metrics as gateway_metrics

from corral_cli.chartgen.dashboards import DASHBOARDS
from corral_cli.chartgen.grafana import RATE_INTERVAL

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # label values are not metric names
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])(vllm:[a-z0-9_]+|corral_[a-z0-9_]+)(?![A-Za-z0-9_:])")


@dataclass(frozen=True, slots=True)
class Query:
    dashboard: str
    panel: str
    legend: str
    expr: str
    is_event_driven: bool = False  # no series until such an event happens


def fill(expr: str, model: str = ".*", rate_interval: str = "1m") -> str:
    """Replace the Grafana variables a dashboard query uses; `model` goes into a regex matcher."""
    return expr.replace(RATE_INTERVAL, rate_interval).replace("$model", model)


def dashboard_queries(model: str = ".*", rate_interval: str = "1m") -> list[Query]:
    out = []
    for name, build in DASHBOARDS.items():
        for panel in build().panels():
            for target in panel.targets:
                expr = fill(target.expr, model, rate_interval)
                out.append(Query(name, panel.title, target.legend, expr, panel.is_event_driven))
    return out


def metric_names(expr: str) -> set[str]:
    """Corral and vLLM metric names in a PromQL expression, histogram suffixes dropped."""
    names = set()
    for name in _METRIC.findall(_STRING.sub('""', expr)):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def _declared(module: ModuleType) -> set[str]:
    return {
        value
        for key, value in vars(module).items()
        if key.isupper() and isinstance(value, str) and _METRIC.fullmatch(value)
    }


def declared_metric_names() -> set[str]:
    """Every metric name the engine's wire contract and the gateway's metrics module declare."""
    return _declared(wire) | _declared(gateway_metrics)
