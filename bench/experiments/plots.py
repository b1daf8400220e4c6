"""One PNG per experiment from its result document (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.experiments.tables import kv_tokens, rate_text, throughput_grid


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _value(row: dict[str, Any] | None, key: str) -> float:
    return float("nan") if row is None or row.get(key) is None else float(row[key])


def plot_rate_x_seqs(doc: dict[str, Any], path: Path) -> None:
    """One line per max_num_seqs: output throughput and TTFT p99 against request rate."""
    plt = _pyplot()
    seqs, rates, cells = throughput_grid(doc)
    xs = list(range(len(rates)))
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in seqs:
        label = f"max_num_seqs {s}"
        ax_tput.plot(
            xs, [_value(cells.get((s, r)), "output_throughput") for r in rates], marker="o", label=label
        )
        ax_ttft.plot(xs, [_value(cells.get((s, r)), "p99_ttft_ms") for r in rates], marker="o", label=label)
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.set_ylim(bottom=0)
    ax_tput.set_title("output throughput")
    ax_ttft.set_ylabel("ms (log scale)")
    ax_ttft.set_yscale("log")
    ax_ttft.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax_ttft.yaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    ax_ttft.set_title("TTFT p99")
    for ax in (ax_tput, ax_ttft):
        ax.set_xticks(xs, [rate_text(r) for r in rates])
        ax.set_xlabel("request rate (req/s; inf = all at once)")
        ax.grid(alpha=0.3)
    ax_tput.legend(fontsize=8)
    _save(fig, plt, doc, path)


def _twin(doc: dict[str, Any], path: Path, xs: list[float], xlabel: str, log_x: bool) -> None:
    """Output throughput (left axis) and preemptions (right axis) against one setting."""
    plt = _pyplot()
    rows = doc["runs"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(xs, [_value(r, "output_throughput") for r in rows], marker="o", color="tab:blue")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.set_ylim(bottom=0)
    right = ax.twinx()
    right.plot(xs, [_value(r, "num_preemptions") for r in rows], marker="s", color="tab:red", linestyle="--")
    right.set_ylabel("preemptions per run", color="tab:red")
    right.set_ylim(bottom=0)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    _save(fig, plt, doc, path)


def plot_preemptions(doc: dict[str, Any], path: Path) -> None:
    xs = [float(r["max_num_seqs"]) for r in doc["runs"]]
    _twin(doc, path, xs, "max_num_seqs", log_x=False)


def plot_kv_budget(doc: dict[str, Any], path: Path) -> None:
    xs = [float(kv_tokens(doc, r) or 0) for r in doc["runs"]]
    mib = doc["kv_bytes_per_token"] / 2**20
    _twin(doc, path, xs, f"KV budget (tokens; 1 token = {mib * 1024:g} KiB)", log_x=True)


def plot_policy(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars per (KV budget, rate): throughput, TTFT p99 and preemptions for each policy."""
    plt = _pyplot()
    rows = doc["runs"]
    groups = list(dict.fromkeys((r["num_kv_blocks"], rate_text(r["request_rate"])) for r in rows))
    variants = list(dict.fromkeys(r["variant"] or r["kv_policy"] for r in rows))
    panels = (
        ("output_throughput", "output tokens/s"),
        ("p99_ttft_ms", "TTFT p99 (ms)"),
        ("num_preemptions", "preemptions"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4.2))
    width = 0.8 / len(variants)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, variant in enumerate(variants):
            by_group = {
                (r["num_kv_blocks"], rate_text(r["request_rate"])): r
                for r in rows
                if (r["variant"] or r["kv_policy"]) == variant
            }
            heights = [_value(by_group.get(g), key) for g in groups]
            ax.bar([j + i * width for j in range(len(groups))], heights, width, label=variant)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{b}\n{rate}" for b, rate in groups], fontsize=8)
        ax.set_xlabel("KV blocks / request rate (req/s)", fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(variants), fontsize=9)
    _save(fig, plt, doc, path, bottom=0.1)


def _save(fig: Any, plt: Any, doc: dict[str, Any], path: Path, bottom: float = 0.0) -> None:
    fig.suptitle(f"{doc['title']}\n{doc['preset']} demo model, {doc['date_utc']} UTC", fontsize=10)
    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))
    fig.savefig(path, dpi=90)
    plt.close(fig)


PLOTS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "rate-x-seqs": plot_rate_x_seqs,
    "preemptions": plot_preemptions,
    "kv-budget": plot_kv_budget,
    "policy": plot_policy,
}


def plot(doc: dict[str, Any], path: Path) -> None:
    PLOTS[doc["experiment"]](doc, path)
