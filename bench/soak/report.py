"""The soak run's figures (pure): per process, its resident memory after the warm-up, at the end and
at its peak, the trend as MiB an hour (least squares over the samples after the warm-up), file
descriptors and threads first and last, and the collector's full passes in each half; the requests
by kind and outcome; the Markdown table and the plot."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# One sample of one process: t_s (since the traffic started), rss_mib, fds, threads, cpu_s,
# gc_full_passes, gc_full_s (cumulative), and for engines running, waiting, kv_usage.
Sample = dict[str, float]


def slope_per_hour(ts: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of values over ts (seconds), scaled to an hour; 0 for fewer than two times."""
    if len(ts) < 2 or len(set(ts)) < 2:
        return 0.0
    mean_t, mean_v = statistics.fmean(ts), statistics.fmean(values)
    num = sum((t - mean_t) * (v - mean_v) for t, v in zip(ts, values, strict=True))
    den = sum((t - mean_t) ** 2 for t in ts)
    return 3600.0 * num / den


def _full_pass_mean_ms(first: Sample, last: Sample) -> float | None:
    passes = last["gc_full_passes"] - first["gc_full_passes"]
    return 1000.0 * (last["gc_full_s"] - first["gc_full_s"]) / passes if passes > 0 else None


def process_summary(samples: Sequence[Sample], warmup_s: float) -> dict[str, Any]:
    """One process's figures from its samples (in time order; those before `warmup_s` only set the
    start of the collector's count)."""
    steady = [s for s in samples if s["t_s"] >= warmup_s] or list(samples[-1:])
    first, last = steady[0], steady[-1]
    middle = steady[len(steady) // 2]
    return {
        "num_samples": len(steady),
        "rss_mib_start": first["rss_mib"],
        "rss_mib_end": last["rss_mib"],
        "rss_mib_peak": max(s["rss_mib"] for s in steady),
        "rss_mib_per_hour": slope_per_hour([s["t_s"] for s in steady], [s["rss_mib"] for s in steady]),
        "fds_start": first["fds"],
        "fds_end": last["fds"],
        "threads_start": first["threads"],
        "threads_end": last["threads"],
        "cpu_s": last["cpu_s"] - first["cpu_s"],
        "gc_full_passes": last["gc_full_passes"] - first["gc_full_passes"],
        "gc_full_pass_ms_first_half": _full_pass_mean_ms(first, middle),
        "gc_full_pass_ms_second_half": _full_pass_mean_ms(middle, last),
    }


def outcomes(results: Sequence[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """(kind, outcome) pairs -> kind -> outcome -> count."""
    out: dict[str, Counter[str]] = {}
    for kind, outcome in results:
        out.setdefault(kind, Counter())[outcome] += 1
    return {kind: dict(counts) for kind, counts in sorted(out.items())}


def table(processes: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| process | RSS after warm-up / end / peak (MiB) | trend (MiB an hour) | fds start / end "
        "| threads start / end | CPU s | full passes | full pass ms, first / second half |",
        "|---|---|---:|---|---|---:|---:|---|",
    ]
    for name, s in processes.items():
        halves = " / ".join(
            "-" if v is None else f"{v:.1f}"
            for v in (s["gc_full_pass_ms_first_half"], s["gc_full_pass_ms_second_half"])
        )
        lines.append(
            f"| {name} | {s['rss_mib_start']:.1f} / {s['rss_mib_end']:.1f} / {s['rss_mib_peak']:.1f} "
            f"| {s['rss_mib_per_hour']:+.1f} | {s['fds_start']:.0f} / {s['fds_end']:.0f} "
            f"| {s['threads_start']:.0f} / {s['threads_end']:.0f} | {s['cpu_s']:.1f} "
            f"| {s['gc_full_passes']:.0f} | {halves} |"
        )
    return "\n".join(lines)


def plot(samples: dict[str, Sequence[Sample]], warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_load) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, series in samples.items():
        ax_rss.plot([s["t_s"] / 60 for s in series], [s["rss_mib"] for s in series], label=name)
    ax_rss.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    ax_rss.set_ylabel("resident memory (MiB)")
    ax_rss.legend()
    engine = samples.get("engine", [])
    ax_load.plot([s["t_s"] / 60 for s in engine], [s.get("running", 0.0) for s in engine], label="running")
    ax_load.plot([s["t_s"] / 60 for s in engine], [s.get("waiting", 0.0) for s in engine], label="waiting")
    ax_load.set_ylabel("engine requests")
    ax_load.set_xlabel("minutes")
    ax_load.legend()
    fig.suptitle("Soak: a simulated fleet and a gateway under steady mixed traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
