"""Grafana dashboard JSON from small typed pieces: PromQL helpers, panels laid out on a grid, variables.

Pure functions: the dashboards module describes panels, this one turns them into Grafana's JSON model
(schema version 39, Prometheus datasource chosen by a `datasource` variable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RATE_INTERVAL = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
PANEL_HEIGHT = 8
SCHEMA_VERSION = 39


# -- PromQL --------------------------------------------------------------------------------------


def sel(metric: str, **matchers: str) -> str:
    """`metric{k=~"v"}`; a value starting with `=` or `!` keeps its own operator (`status='!~"2.."'`)."""
    if not matchers:
        return metric
    parts = []
    for key, value in matchers.items():
        parts.append(f"{key}{value}" if value[:1] in ("=", "!") else f'{key}=~"{value}"')
    return f"{metric}{{{','.join(parts)}}}"


def rate(selector: str) -> str:
    return f"rate({selector}[{RATE_INTERVAL}])"


def increase(selector: str) -> str:
    return f"increase({selector}[{RATE_INTERVAL}])"


def sum_by(by: str, expr: str) -> str:
    return f"sum by ({by}) ({expr})"


def max_by(by: str, expr: str) -> str:
    return f"max by ({by}) ({expr})"


def quantile(q: float, histogram: str, by: str, **matchers: str) -> str:
    """The q-quantile of a histogram's rate, grouped by `by` (besides `le`)."""
    buckets = rate(sel(histogram + "_bucket", **matchers))
    return f"histogram_quantile({q}, sum by (le, {by}) ({buckets}))"


# -- panels --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    width: int = 12
    kind: str = "timeseries"
    max_value: float | None = None
    # Series appear only once such events happen (errors, retries, ejections): empty on a healthy fleet.
    is_event_driven: bool = False
    no_value: str | None = None  # shown instead of "No data" (a feature the fleet may not use)
    # kind "table": a row per series of an instant query; (field, header) columns in this order,
    # a field being a label or "Value" (the sample's value).
    columns: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    label: str
    query: str  # a label_values(...) query
    is_multi: bool = False
    include_all: bool = False


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...] = field(default_factory=tuple)
    tags: tuple[str, ...] = ("corral",)

    def panels(self) -> list[Panel]:
        return [p for row in self.rows for p in row.panels]


def _table_json(panel: Panel) -> dict[str, Any]:
    """A table's options, and the transformation that hides the sample time and names the columns."""
    order = [label for label, _ in panel.columns]
    return {
        "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True},
                    "indexByName": {label: i for i, label in enumerate(order)},
                    "renameByName": dict(panel.columns),
                },
            }
        ],
    }


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.max_value is not None:
        defaults["min"] = 0
        defaults["max"] = panel.max_value
    if panel.no_value is not None:
        defaults["noValue"] = panel.no_value
    is_table = panel.kind == "table"
    out: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": t.expr,
                "legendFormat": t.legend,
                # A table shows each series' latest sample (its labels are the content).
                **({"format": "table", "instant": True, "range": False} if is_table else {"range": True}),
            }
            for i, t in enumerate(panel.targets)
        ],
    }
    if is_table:
        out.update(_table_json(panel))
    return out


def _variable_json(var: Variable) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": var.name,
        "label": var.label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": var.query, "refId": f"{var.name}-variable"},
        "definition": var.query,
        "refresh": 2,
        "sort": 1,
        "multi": var.is_multi,
        "includeAll": var.include_all,
        "current": {},
        "hide": 0,
    }
    if var.include_all:
        out["allValue"] = ".*"  # also matches models that have no engine series (e.g. a typo'd name)
    return out


def to_json(dashboard: Dashboard) -> dict[str, Any]:
    """Grafana's dashboard model; panels flow left to right, rows stack top to bottom."""
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row in dashboard.rows:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y = 0, y + PANEL_HEIGHT
            panels.append(_panel_json(panel, next_id, x, y))
            next_id += 1
            x += panel.width
        y += PANEL_HEIGHT
    datasource_var = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
    }
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": list(dashboard.tags),
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "version": 1,
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [datasource_var, *(_variable_json(v) for v in dashboard.variables)]},
        "panels": panels,
    }
