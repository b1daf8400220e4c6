"""Markdown tables from an experiment's result document (pure: dicts in, text out)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
Column = tuple[str, Callable[[Row], str]]


def load_result(path: str | Path) -> dict[str, Any]:
    """A result file as written by `python -m bench.experiments`: {"benchmark": meta, "runs": [...]}."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list) or "benchmark" not in doc:
        raise ValueError(f"{path} is not an experiment result file")
    return {**doc["benchmark"], "runs": doc["runs"]}


def rate_value(rate: Any) -> float:
    """A request rate from a result file: a number, or the string "inf"."""
    return math.inf if rate == "inf" else float(rate)


def rate_text(rate: Any) -> str:
    value = rate_value(rate)
    return "inf" if math.isinf(value) else f"{value:g}"


def num(value: Any, digits: int = 0) -> str:
    """A number for a table cell; "n/a" for missing values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{float(value):,.{digits}f}"


def markdown(columns: Sequence[Column], rows: Sequence[Row]) -> str:
    head = "| " + " | ".join(name for name, _ in columns) + " |"
    rule = "|" + "|".join("---:" for _ in columns) + "|"
    body = ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def kv_tokens(doc: dict[str, Any], row: Row) -> int | None:
    blocks = row.get("num_kv_blocks")
    return None if blocks is None else int(blocks) * int(doc["block_size"])


def kv_mib(doc: dict[str, Any], row: Row) -> float | None:
    tokens = kv_tokens(doc, row)
    return None if tokens is None else tokens * int(doc["kv_bytes_per_token"]) / 2**20


def throughput_grid(doc: dict[str, Any]) -> tuple[list[int], list[float], dict[tuple[int, float], Row]]:
    """(max_num_seqs values, rates, (seqs, rate) -> row) of a rate-x-seqs result, in run order."""
    seqs: list[int] = []
    rates: list[float] = []
    cells: dict[tuple[int, float], Row] = {}
    for row in doc["runs"]:
        s, r = int(row["max_num_seqs"]), rate_value(row["request_rate"])
        seqs += [] if s in seqs else [s]
        rates += [] if r in rates else [r]
        cells[(s, r)] = row
    return seqs, sorted(rates), cells


def _grid_cell(cells: dict[tuple[int, float], Row], rate: float, key: str) -> Callable[[Row], str]:
    return lambda row: num(cells.get((row["seqs"], rate), {}).get(key))


def rate_x_seqs_table(doc: dict[str, Any]) -> str:
    """Output tokens/s with max_num_seqs down and request rate across; then TTFT p99 the same way."""
    seqs, rates, cells = throughput_grid(doc)
    parts = []
    for key, what in (("output_throughput", "output tok/s"), ("p99_ttft_ms", "TTFT p99 (ms)")):
        columns: list[Column] = [("max_num_seqs", lambda row: str(row["seqs"]))]
        for rate in rates:
            label = f"{rate_text(rate)} req/s"
            columns.append((label, _grid_cell(cells, rate, key)))
        parts.append(f"**{what}** by request rate\n\n" + markdown(columns, [{"seqs": s} for s in seqs]))
    return "\n\n".join(parts)


_LATENCY_COLUMNS: list[Column] = [
    ("out tok/s", lambda r: num(r["output_throughput"])),
    ("TTFT p50 ms", lambda r: num(r["median_ttft_ms"])),
    ("TTFT p99 ms", lambda r: num(r["p99_ttft_ms"])),
    ("TPOT mean ms", lambda r: num(r["mean_tpot_ms"], 1)),
    ("E2E mean ms", lambda r: num(r["mean_e2el_ms"])),
    ("preemptions", lambda r: num(r["num_preemptions"])),
    ("ok/failed", lambda r: f"{r['completed']}/{r['failed']}"),
]


def preemptions_table(doc: dict[str, Any]) -> str:
    columns: list[Column] = [("max_num_seqs", lambda r: str(r["max_num_seqs"]))]
    return markdown(columns + _LATENCY_COLUMNS, doc["runs"])


def kv_budget_table(doc: dict[str, Any]) -> str:
    columns: list[Column] = [
        ("KV blocks", lambda r: str(r["num_kv_blocks"])),
        ("KV tokens", lambda r: num(kv_tokens(doc, r))),
        ("KV MiB", lambda r: num(kv_mib(doc, r), 2)),
    ]
    return markdown(columns + _LATENCY_COLUMNS, doc["runs"])


def policy_table(doc: dict[str, Any]) -> str:
    columns: list[Column] = [
        ("KV blocks (tokens)", lambda r: f"{r['num_kv_blocks']} ({num(kv_tokens(doc, r))})"),
        ("rate req/s", lambda r: rate_text(r["request_rate"])),
        ("policy", lambda r: r["variant"] or r["kv_policy"]),
        (
            "max_tokens",
            lambda r: "sampled length" if r["max_tokens_cap"] is None else str(r["max_tokens_cap"]),
        ),
    ]
    extra: list[Column] = [("E2E p99 ms", lambda r: num(r["p99_e2el_ms"]))]
    return markdown(columns + _LATENCY_COLUMNS[:5] + extra + _LATENCY_COLUMNS[5:], doc["runs"])


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "rate-x-seqs": rate_x_seqs_table,
    "preemptions": preemptions_table,
    "kv-budget": kv_budget_table,
    "policy": policy_table,
}


def render(doc: dict[str, Any]) -> str:
    """The experiment's table(s) under a one-line header naming the run."""
    meta = (
        f"{doc['title']}: {doc['date_utc']} UTC, `{doc['preset']}` demo model, {doc['num_cpus']} CPUs, "
        f"engine {doc.get('engine_source', 'n/a')}, {doc['wall_time_s']:.0f} s"
        + (" (--quick)" if doc.get("quick") else "")
    )
    return meta + "\n\n" + TABLES[doc["experiment"]](doc)
