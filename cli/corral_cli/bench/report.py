"""Present benchmark results: rich tables, the result JSON, and matplotlib figures (Agg backend)."""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from corral_cli.bench.stats import LATENCIES, RequestResult, latency_samples

_LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
_STATS = ("mean", "median", "p90", "p99")
_E2E_STATS = (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))
# Off a terminal (a CI log, a pipe) rich would fit tables to 80 columns and cut figures to "1,28…";
# this is wide enough for any table here, which still prints at its natural width.
_MAX_LOG_WIDTH = 1000


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def is_generation_summary(summary: dict[str, Any]) -> bool:
    """Whether a run generated tokens (completions, chat), not vectors or scores."""
    return "total_inputs" not in summary


def _latency_kinds(summary: dict[str, Any]) -> tuple[str, ...]:
    """Embeddings and rerank requests have an end-to-end latency only."""
    return LATENCIES if is_generation_summary(summary) else ("e2el",)


def _throughput_rows(summary: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    if not is_generation_summary(summary):
        return (
            ("request throughput (req/s)", _fmt(summary["request_throughput"])),
            ("input throughput (inputs/s)", _fmt(summary["input_item_throughput"], 1)),
            ("input throughput (tok/s)", _fmt(summary["input_throughput"], 1)),
            ("server preemptions", _fmt(summary["num_preemptions"], 0)),
            ("client CPU per input (µs)", _fmt(_cpu_per_us(summary, "total_inputs"), 1)),
        )
    return (
        ("request throughput (req/s)", _fmt(summary["request_throughput"])),
        ("input throughput (tok/s)", _fmt(summary["input_throughput"], 1)),
        ("output throughput (tok/s)", _fmt(summary["output_throughput"], 1)),
        ("total throughput (tok/s)", _fmt(summary["total_token_throughput"], 1)),
        ("server preemptions", _fmt(summary["num_preemptions"], 0)),
        ("client CPU per output token (µs)", _fmt(_cpu_per_us(summary, "total_output_tokens"), 1)),
    )


def run_table(summary: dict[str, Any]) -> Table:
    """Counts, throughputs and the latency distributions of one run (E2E only for embeddings and
    rerank)."""
    table = Table(title=f"corral bench: request rate {rate_label(summary['request_rate'])} req/s")
    table.add_column("metric", overflow="fold")
    for stat in _STATS:
        table.add_column(f"{stat} (ms)", justify="right", overflow="fold")
    for kind in _latency_kinds(summary):
        table.add_row(_LATENCY_NAMES[kind], *(_fmt(summary[f"{stat}_{kind}_ms"]) for stat in _STATS))
    table.add_section()
    rows = (
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", _fmt(summary["duration_s"])),
        *_throughput_rows(summary),
    )
    for name, value in rows:
        table.add_row(name, value, "", "", "")
    table.caption = _preemptions_caption([summary])
    return table


def _preemptions_caption(summaries: list[dict[str, Any]]) -> str | None:
    """Why the server's preemptions read n/a (against a gateway, say), so n/a is not read as none."""
    reasons = dict.fromkeys(
        s["preemptions_unknown_why"] for s in summaries if s.get("preemptions_unknown_why")
    )
    return "preemptions n/a: " + "; ".join(reasons) if reasons else None


def _cpu_per_us(summary: dict[str, Any], per: str) -> float | None:
    """The client's CPU per output token (or per input), in microseconds."""
    cpu_s, count = summary.get("client_cpu_s"), summary.get(per)
    return 1e6 * cpu_s / count if cpu_s is not None and count else None


def _pooling_columns() -> tuple[tuple[str, Callable[[dict[str, Any]], str]], ...]:
    return (
        ("rate", lambda s: rate_label(s["request_rate"])),
        ("ok/fail", lambda s: f"{s['completed']}/{s['failed']}"),
        ("req/s", lambda s: _fmt(s["request_throughput"])),
        ("inputs/s", lambda s: _fmt(s["input_item_throughput"], 1)),
        ("in tok/s", lambda s: _fmt(s["input_throughput"], 1)),
        ("E2E mean", lambda s: _fmt(s["mean_e2el_ms"], 1)),
        ("E2E p50", lambda s: _fmt(s["median_e2el_ms"], 1)),
        ("E2E p90", lambda s: _fmt(s["p90_e2el_ms"], 1)),
        ("E2E p99", lambda s: _fmt(s["p99_e2el_ms"], 1)),
        ("preempt", lambda s: _fmt(s["num_preemptions"], 0)),
    )


def sweep_table(summaries: list[dict[str, Any]]) -> Table:
    table = Table(title="corral bench: request-rate sweep (rates in req/s, latencies in ms)")
    columns = _generation_columns() if is_generation_summary(summaries[0]) else _pooling_columns()
    for name, _ in columns:
        table.add_column(name, justify="right", overflow="fold")
    for summary in summaries:
        table.add_row(*(cell(summary) for _, cell in columns))
    table.caption = _preemptions_caption(summaries)
    return table


def _generation_columns() -> tuple[tuple[str, Callable[[dict[str, Any]], str]], ...]:
    return (
        ("rate", lambda s: rate_label(s["request_rate"])),
        ("ok/fail", lambda s: f"{s['completed']}/{s['failed']}"),
        ("req/s", lambda s: _fmt(s["request_throughput"])),
        ("out tok/s", lambda s: _fmt(s["output_throughput"], 1)),
        ("TTFT mean", lambda s: _fmt(s["mean_ttft_ms"], 1)),
        ("TTFT p99", lambda s: _fmt(s["p99_ttft_ms"], 1)),
        ("TPOT mean", lambda s: _fmt(s["mean_tpot_ms"], 1)),
        ("ITL p99", lambda s: _fmt(s["p99_itl_ms"], 1)),
        ("E2E mean", lambda s: _fmt(s["mean_e2el_ms"], 1)),
        ("preempt", lambda s: _fmt(s["num_preemptions"], 0)),
    )


def report_console() -> Console:
    """stdout's console; off a terminal, one wide enough that no table is cut or wrapped.
    (On a narrow terminal the columns fold: every digit is kept, on more lines.)"""
    console = Console()
    return console if console.is_terminal else Console(width=_MAX_LOG_WIDTH)


def print_report(summaries: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or report_console()
    if len(summaries) == 1:
        console.print(run_table(summaries[0]))
    else:
        console.print(sweep_table(summaries))


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: NaN becomes null, an infinite rate the string "inf"."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def prepare_output_file(path: str, flag: str) -> None:
    """Before a run: create the folders above `path`, so writing it after the run cannot fail on
    them; ValueError (one line) when it cannot be written there."""
    file = pathlib.Path(path)
    if file.is_dir():
        raise ValueError(f"{flag} {path} is a directory")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create its folder: {e.strerror or e}") from e
    if not os.access(file.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: its folder is not writable")


def check_plot_format(path: str) -> None:
    """ValueError unless matplotlib writes the format `path`'s extension names (savefig picks the
    format from it; without one it would write `path`.png instead)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = pathlib.Path(path).suffix.lower().removeprefix(".")
    if suffix not in formats:
        what = f"a .{suffix} file" if suffix else "a file without an extension"
        raise ValueError(f"--plot {path}: matplotlib cannot write {what}; use .png, .svg or .pdf")


def write_result_file(
    path: str | pathlib.Path, config: dict[str, Any], summaries: list[dict[str, Any]]
) -> None:
    document = {"benchmark": config, "runs": summaries}
    text = json.dumps(_json_safe(document), indent=2, allow_nan=False)
    pathlib.Path(path).write_text(text + "\n", encoding="utf-8")


def plot_latency_distributions(results: list[RequestResult], path: str | pathlib.Path, title: str) -> None:
    """Histograms of TTFT, TPOT, ITL and E2E latency (ms) with p50/p99 marked; of E2E alone for
    embeddings and rerank requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    samples = latency_samples(results)
    if all(r.is_generation for r in results):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        panels = list(zip(axes.flat, LATENCIES, strict=True))
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        panels = [(ax, "e2el")]
    for ax, kind in panels:
        values = np.asarray(samples[kind]) * 1000.0
        ax.set_title(_LATENCY_NAMES[kind])
        ax.set_xlabel("ms")
        if values.size == 0:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=min(50, max(5, values.size // 4)), color="tab:blue", alpha=0.8)
        for q, style in ((50, "--"), (99, ":")):
            ax.axvline(float(np.percentile(values, q)), color="black", linestyle=style, label=f"p{q}")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(summaries: list[dict[str, Any]], path: str | pathlib.Path, title: str) -> None:
    """Throughput and latency against request rate (an infinite rate is drawn as the last point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(summaries)))
    labels = [rate_label(s["request_rate"]) for s in summaries]

    def series(key: str) -> list[float]:
        return [float("nan") if s[key] is None else float(s[key]) for s in summaries]

    throughputs, latencies, tput_unit = _sweep_series(summaries[0])
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (key, name), marker in zip(throughputs, "os^", strict=False):
        ax_tput.plot(xs, series(key), marker=marker, label=name)
    ax_tput.set_ylabel(tput_unit)
    if not is_generation_summary(summaries[0]):
        ax_tput.set_yscale("log")  # requests, inputs and tokens per second differ by orders of magnitude
    ax_tput.set_title("throughput")
    for key, name in latencies:
        ax_lat.plot(xs, series(key), marker="o", label=name)
    ax_lat.set_ylabel("ms")
    ax_lat.set_yscale("log")
    ax_lat.set_title("latency")
    for ax in (ax_tput, ax_lat):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sweep_series(summary: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """(throughput keys and names, latency keys and names, the throughput axis's unit) to plot."""
    if is_generation_summary(summary):
        throughputs = [("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s")]
        latencies = [
            ("mean_ttft_ms", "TTFT mean"),
            ("p99_ttft_ms", "TTFT p99"),
            ("mean_tpot_ms", "TPOT mean"),
            ("p99_itl_ms", "ITL p99"),
        ]
        return throughputs, latencies, "tokens/s"
    throughputs = [
        ("request_throughput", "requests/s"),
        ("input_item_throughput", "inputs/s"),
        ("input_throughput", "input tok/s"),
    ]
    latencies = [(f"{stat}_e2el_ms", f"E2E {name}") for stat, name in _E2E_STATS]
    return throughputs, latencies, "per second (log)"
