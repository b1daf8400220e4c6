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


def _fleet(cell: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    """The fleet column: the replica count, and the profile where the cells mix profiles."""
    if len({c.get("profile") for c in cells}) > 1:
        return f"{cell['replicas']} ({cell.get('profile') or 'profile unknown'})"
    return str(cell["replicas"])


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
                f"| {_fleet(cell, cells)} | {cell['workload']} | {cell['load']:.2f} | {cell['arrivals']} | "
                f"{policy} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | "
                f"{r['tpot_p99_ms']:.1f} | {r['goodput_req_s']:.1f} | {100 * r['slo_share']:.1f}% | "
                f"{r['output_tok_s']:.0f} | {r['prefix_hit_rate']:.2f} | {r['preemptions']} | "
                f"{_ratio(cell, policy, 'round-robin', 'ttft_p99_ms')} | "
                f"{_ratio(cell, policy, 'llm-d', 'ttft_p99_ms')} | "
                f"{_ratio(cell, policy, 'llm-d', 'goodput_req_s')} |"
            )
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    if not cells:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    policies = list(dict.fromkeys(p for c in cells for p in c["policies"]))
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
                        (c["load"], c["policies"][policy][key])
                        for c in mine
                        if c["arrivals"] == arrivals and policy in c["policies"]
                    )
                    if pts:
                        label = policy if arrivals == "poisson" else None
                        ax.plot(
                            *zip(*pts, strict=True), style, color=colors[policy], label=label, markersize=7
                        )
            floors = sorted((c["load"], c["floor"]["ttft_p99_ms"]) for c in mine if "floor" in c)
            if key == "ttft_p99_ms" and floors:  # no policy's p99 can go below it
                ax.plot(*zip(*floors, strict=True), "_", color="black", markersize=18, label="TTFT floor")
            ax.set_title(f"{workload}, {mine[0]['replicas']} replicas: {title}")
            ax.set_xlabel("offered load (x capacity; x = bursty)")
            if log:
                ax.set_yscale("log")
        axes[row][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(cells: list[dict[str, Any]]) -> str:
    """One line per (replicas, workload, arrivals, load): the p99 of the TTFT floor (`ttft_floor`,
    which no policy's p99 can go below), p99 TTFT per policy, round-robin's p99 against the floor
    (under 2x, no policy can reach half of round-robin's p99), then the default's p99 and goodput
    against round-robin's and llm-d's, and prefix-cache hit rates."""
    names = ("round-robin", "least-requests", "kv-aware", "prefix-affinity", "llm-d")
    short = {
        "round-robin": "RR",
        "least-requests": "LR",
        "kv-aware": "KV",
        "prefix-affinity": "PA",
        "llm-d": "llm-d",
    }
    head = " | ".join(f"p99 {short[n]}" for n in names)
    lines = [
        f"| fleet | workload | arrivals | load | p99 floor | {head} | RR / floor | PA p99 / RR "
        "| PA p99 / llm-d | PA goodput / RR | PA goodput / llm-d | in SLO RR / PA / llm-d "
        "| hits RR / PA / llm-d |",
        "|---|---|---|---:|" + "---:|" * (len(names) + 8),
    ]
    for c in cells:
        rows = c["policies"]
        p99 = " | ".join(f"{rows[n]['ttft_p99_ms']:.0f}" if n in rows else "-" for n in names)
        floor = c.get("floor", {}).get("ttft_p99_ms")
        rr = rows.get("round-robin", {}).get("ttft_p99_ms")
        floor_text = "-" if floor is None else f"{floor:.0f}"
        rr_floor = "-" if floor is None or rr is None else f"{rr / floor:.2f}x"

        def ratio(key: str, peer: str, rows: dict[str, Any] = rows) -> str:
            if DEFAULT not in rows or peer not in rows or not rows[peer][key]:
                return "-"
            return f"{rows[DEFAULT][key] / rows[peer][key]:.2f}x"

        def trio(key: str, fmt: str, rows: dict[str, Any] = rows) -> str:
            return " / ".join(
                format(rows[n][key], fmt) if n in rows else "-" for n in ("round-robin", DEFAULT, "llm-d")
            )

        lines.append(
            f"| {_fleet(c, cells)} | {c['workload']} | {c['arrivals']} | {c['load']:.2f} | {floor_text} | "
            f"{p99} | {rr_floor} | {ratio('ttft_p99_ms', 'round-robin')} | {ratio('ttft_p99_ms', 'llm-d')} | "
            f"{ratio('goodput_req_s', 'round-robin')} | {ratio('goodput_req_s', 'llm-d')} | "
            f"{trio('slo_share', '.0%')} | {trio('prefix_hit_rate', '.2f')} |"
        )
    return "\n".join(lines)
