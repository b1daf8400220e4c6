"""PNG charts of one comparison (matplotlib, Agg): offline throughput and latency, served runs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from report import Results, figures

_COLORS = {"corral": "#1f77b4", "corral-t213": "#6baed6", "vllm": "#d62728", "transformers": "#7f7f7f"}


def _bars(ax, keys: list[str], titles: list[str], results: Results, ylabel: str) -> None:  # type: ignore[no-untyped-def]
    fig = figures(results)
    systems = list(results["systems"])
    width = 0.8 / max(1, len(systems))
    for i, name in enumerate(systems):
        vals = [fig[k].get(name) or 0.0 for k in keys]
        xs = [j + i * width for j in range(len(keys))]
        bars = ax.bar(
            xs, vals, width, label=results["systems"][name].get("label", name), color=_COLORS.get(name)
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(keys))], titles)
    ax.set_ylabel(ylabel)


def plot_all(results: Results, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    _bars(axes[0], ["W1_offline_tok_s", "W2_offline_tok_s"], ["W1", "W2"], results, "output tokens/s")
    axes[0].set_title("Offline (Python API) throughput, higher is better")
    _bars(axes[1], ["S1_tpot_ms"], ["S1"], results, "ms per output token")
    axes[1].set_title("S1 time per output token, lower is better")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "engine-speed-offline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    served = [s for s, r in results["systems"].items() if r.get("served", {}).get("runs")]
    if served:
        sub = {**results, "systems": {s: results["systems"][s] for s in served}}
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        _bars(
            axes[0],
            ["W1_served_tok_s", "W2_served_tok_s", "W2_r16_tok_s", "W2_r4_tok_s"],
            ["W1 all", "W2 all", "W2 16/s", "W2 4/s"],
            sub,
            "output tokens/s",
        )
        axes[0].set_title("Served (HTTP, streaming) throughput")
        _bars(axes[1], ["W2_r16_ttft_p99_ms", "W2_r4_ttft_p99_ms"], ["W2 16/s", "W2 4/s"], sub, "ms")
        axes[1].set_title("Served TTFT p99, lower is better")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "engine-speed-served.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if results.get("served_over_offline"):
        written.append(_served_over_offline(results, out_dir / "engine-speed-served-over-offline.png"))
    return written


def _served_over_offline(results: Results, path: Path) -> Path:
    """Served / offline output tok/s per system and workload: the median as a bar, each round as a
    dot, issue 21's 0.95x as a line."""
    table = results["served_over_offline"]
    workloads = sorted({w for per in table.values() for w in per})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(table))
    for i, (name, per) in enumerate(table.items()):
        xs = [j + i * width for j in range(len(workloads))]
        medians = [per.get(w, {}).get("median", 0.0) for w in workloads]
        bars = ax.bar(
            xs, medians, width, label=results["systems"].get(name, {}).get("label", name), alpha=0.7
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
        for x, w in zip(xs, workloads, strict=True):
            ratios = per.get(w, {}).get("ratios", [])
            ax.plot([x] * len(ratios), ratios, "k.", markersize=5)
    ax.axhline(0.95, color="#d62728", linestyle="--", linewidth=1, label="target 0.95x")
    ax.set_xticks([j + width * (len(table) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("served / offline output tok/s")
    num_rounds = len(results.get("rounds") or [None])
    ax.set_title(f"Served all at once against offline ({num_rounds} round(s); dots: each)", fontsize=9)
    values = [r for per in table.values() for w in per.values() for r in w["ratios"]]
    ax.set_ylim(min(0.9, min(values) - 0.05), max(1.05, max(values) + 0.05))  # the region that matters
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
