"""The simulated-fleet benchmark's Markdown table and plots (p99 TTFT and goodput against load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT = "prefix-affinity"


def _ratio(cell: dict[str, Any], policy: str, baseline: str, key: str) -> str:
    rows = cell["policies"]
    if baseline not in rows or not rows[baseline][key]:
        return "-"
    return f"{rows[policy][key] / rows[baseline][key]:.2f}x"


def table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| replicas | workload | load | arrivals | policy | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
        "| TPOT p99 (ms) | goodput (req/s) | in SLO | output tok/s | prefix hits | preemptions "
        "| p99 / round-robin | p99 / llm-d | goodput / llm-d |",
        "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell in cells:
        for policy, r in cell["policies"].items():
            lines.append(
                f"| {cell['replicas']} | {cell['workload']} | {cell['load']:.2f} | {cell['arrivals']} | "
                f"{policy} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | "
                f"{r['tpot_p99_ms']:.1f} | {r['goodput_req_s']:.1f} | {100 * r['slo_share']:.1f}% | "
                f"{r['output_tok_s']:.0f} | {r['prefix_hit_rate']:.2f} | {r['preemptions']} | "
                f"{_ratio(cell, policy, 'round-robin', 'ttft_p99_ms')} | "
                f"{_ratio(cell, policy, 'llm-d', 'ttft_p99_ms')} | "
                f"{_ratio(cell, policy, 'llm-d', 'goodput_req_s')} |"
            )
    return "\n".join(lines)


def targets(cells: list[dict[str, Any]], load: float = 0.85) -> list[dict[str, Any]]:
    """Per cell at `load`: the default policy's p99 TTFT and goodput against round-robin and llm-d."""
    out = []
    for cell in cells:
        rows = cell["policies"]
        if cell["load"] != load or DEFAULT not in rows:
            continue
        d = rows[DEFAULT]
        entry = {k: cell[k] for k in ("replicas", "workload", "arrivals")}
        for peer in ("round-robin", "llm-d"):
            if peer in rows:
                entry[f"p99_vs_{peer}"] = d["ttft_p99_ms"] / max(1e-9, rows[peer]["ttft_p99_ms"])
                entry[f"goodput_vs_{peer}"] = d["goodput_req_s"] / max(1e-9, rows[peer]["goodput_req_s"])
        out.append(entry)
    return out


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    if not cells:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    policies = list(cells[0]["policies"])
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, 3.6 * len(workloads)), squeeze=False)
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    for row, workload in enumerate(workloads):
        mine = [c for c in cells if c["workload"] == workload]
        for col, (key, title, log) in enumerate(
            (
                ("ttft_p99_ms", "p99 TTFT (ms)", True),
                ("goodput_req_s", "goodput (req/s in SLO)", False),
                ("prefix_hit_rate", "prefix-cache hit rate", False),
            )
        ):
            ax = axes[row][col]
            for policy in policies:
                for arrivals, style in (("poisson", "-o"), ("bursty", "x")):
                    pts = sorted(
                        (c["load"], c["policies"][policy][key]) for c in mine if c["arrivals"] == arrivals
                    )
                    if pts:
                        label = policy if arrivals == "poisson" else None
                        ax.plot(
                            *zip(*pts, strict=True), style, color=colors[policy], label=label, markersize=7
                        )
            ax.set_title(f"{workload}, {mine[0]['replicas']} replicas: {title}")
            ax.set_xlabel("offered load (x capacity; x = bursty)")
            if log:
                ax.set_yscale("log")
        axes[row][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
