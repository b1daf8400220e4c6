"""PNG charts of a GPU run (matplotlib, Agg), one per phase that has figures; phases missing from
the results or failed are left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

_SYSTEM_COLORS = {"corral": "#1f77b4", "hf-static": "#7f7f7f", "hf-cb": "#ff7f0e"}
_SYSTEM_LABELS = {
    "corral": "Corral",
    "hf-static": "transformers static",
    "hf-cb": "transformers continuous",
}


def plot_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    phases = results.get("phases", {})
    title = _title(results)
    written = []
    for name, plot in (
        ("equality", _equality),
        ("batch1", _batch1),
        ("throughput", _throughput),
        ("overhead", _overhead),
    ):
        figures = phases.get(name)
        if not figures or "error" in figures:
            continue
        fig = plot(figures)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out_dir / f"gpu-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _title(results: dict[str, Any]) -> str:
    env = results.get("phases", {}).get("env", {})
    where = env.get("gpu") or f"CPU ({env.get('device', '?')})"
    return f"{where}, {results.get('mode', '?')} run, commit {results.get('commit') or '?'}"


def _equality(figures: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels, shares, colors = [], [], []
    for arch, entry in figures["archs"].items():
        for variant in entry["variants"]:
            eager = variant["engine"]["options"].get("enforce_eager")
            labels.append(f"{arch}\n{'eager' if eager else 'default'}")
            shares.append(variant["num_equal"] / entry["num_prompts"])
            colors.append("#2ca02c" if variant["num_equal"] == entry["num_prompts"] else "#d62728")
    bars = ax.bar(labels, shares, color=colors)
    ax.bar_label(bars, labels=[f"{s:.0%}" for s in shares], fontsize=8)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("prompts with equal greedy output")
    ax.set_title(f"Greedy equality with transformers ({figures['device']}, {figures['dtype']})")
    return fig


def _batch1(figures: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    names = list(figures["variants"])
    for name in names:
        left.plot(figures["variants"][name]["step_ms"], label=name, linewidth=0.8)
    left.set_xlabel("decode step after warm-up")
    left.set_ylabel("ms per output token")
    left.set_title(f"Batch 1, {figures['preset']} ({figures['dtype']})")
    left.legend(fontsize=8)
    tpots = [figures["variants"][n]["tpot_ms"] for n in names]
    bars = right.bar(names, tpots, color="#1f77b4")
    mbus = [figures["variants"][n].get("mbu_ratio") for n in names]
    right.bar_label(
        bars,
        labels=[f"{t:.2f} ms\nMBU {m:.0%}" if m else f"{t:.2f} ms" for t, m in zip(tpots, mbus, strict=True)],
        fontsize=8,
    )
    right.set_ylim(0, 1.3 * max(tpots))
    right.set_ylabel("median ms per output token")
    right.set_title("Time per output token")
    return fig


def _throughput(figures: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4))
    systems = [s for s, v in figures["systems"].items() if v.get("status") == "ok"]
    workload_names = list(figures["workloads"])
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        per = figures["systems"][system]["workloads"]
        values = [per.get(w, {}).get("output_throughput", 0.0) for w in workload_names]
        xs = [j + i * width for j in range(len(workload_names))]
        bars = ax.bar(
            xs, values, width, label=_SYSTEM_LABELS.get(system, system), color=_SYSTEM_COLORS.get(system)
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(workload_names))], workload_names)
    ax.set_ylabel("output tokens/s")
    ratios = ", ".join(
        f"{k.replace('_corral_over_', ' vs ')} {v:.2f}x" for k, v in figures.get("ratios", {}).items()
    )
    ax.set_title(f"Offline throughput, {figures['preset']}: {ratios}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _overhead(figures: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    batches = list(figures["batches"])
    kernel = [figures["batches"][b]["kernel_ms"] for b in batches]
    outside = [
        max(0.0, figures["batches"][b]["step_ms"] - figures["batches"][b]["kernel_ms"]) for b in batches
    ]
    labels = [f"batch {b}" for b in batches]
    ax.bar(labels, kernel, label="device work", color="#1f77b4")
    bars = ax.bar(labels, outside, bottom=kernel, label="outside kernels", color="#d62728")
    shares = [figures["batches"][b]["outside_kernels_ratio"] for b in batches]
    names = ["no device events seen" if r is None else f"{r:.1%} outside" for r in shares]
    ax.bar_label(bars, labels=names, fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Where a decode step goes ({figures['preset']})")
    ax.legend(fontsize=8)
    return fig
