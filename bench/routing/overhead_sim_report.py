"""The simulated-replica overhead benchmark's figures (pure): one arm's summary, the paired per-round
differences between the arms, the gateway's own overhead histogram (read from its /metrics), the
Markdown table and the plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from corral_cli.bench.stats import RequestResult
from corral_gateway.metrics import GC_PAUSE_SECONDS, OVERHEAD_PARTS, OVERHEAD_SECONDS
from prometheus_client.parser import text_string_to_metric_families

# Latency figures compared between the arms: (key, result attribute, percentile).
LATENCY_KEYS = (
    ("ttft_p50_ms", "ttft_s", 50),
    ("ttft_p99_ms", "ttft_s", 99),
    ("e2el_p50_ms", "e2el_s", 50),
    ("e2el_p99_ms", "e2el_s", 99),
)
_MAX_ERRORS_KEPT = 3


def arm_summary(
    results: Sequence[RequestResult], duration_s: float, cpu_s: dict[str, float]
) -> dict[str, Any]:
    """One closed loop's figures: throughput, latency percentiles, errors, and the CPU seconds each
    process used (`cpu_s`: gateway, sim, client) per request and per output token."""
    ok = [r for r in results if r.is_success]
    num_tokens = sum(r.output_len for r in ok)
    out: dict[str, Any] = {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.is_success})[:_MAX_ERRORS_KEPT],
        "duration_s": duration_s,
        "output_tok_s": num_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_s": len(ok) / duration_s if duration_s > 0 else 0.0,
    }
    for key, attr, pct in LATENCY_KEYS:
        values = [getattr(r, attr) for r in ok]
        out[key] = float(np.percentile(values, pct)) * 1000 if values else float("nan")
    for name, used_s in cpu_s.items():
        out[f"{name}_cpu_s"] = used_s
        out[f"{name}_cores"] = used_s / duration_s if duration_s > 0 else 0.0
        out[f"{name}_cpu_ms_per_request"] = 1000 * used_s / max(1, len(ok))
        out[f"{name}_cpu_us_per_token"] = 1e6 * used_s / max(1, num_tokens)
    return out


def hop_summary(results: Sequence[RequestResult], replica: dict[str, float]) -> dict[str, Any]:
    """Mean TTFT and E2E as the client saw them and as the replicas saw them (`replica`: the change
    of their histograms' sums and counts over the arm); the difference is the hop's own share
    (client, network, and the gateway where there is one), free of the replicas' step timing:
    a fixed-step replica turns a few milliseconds of hop into a whole step whenever a request
    misses the step it would have joined, which moves the percentiles by tens of milliseconds."""
    ok = [r for r in results if r.is_success]
    out: dict[str, Any] = {"replica_num_requests": replica["ttft_count"]}
    for key, attr in (("ttft", "ttft_s"), ("e2el", "e2el_s")):
        client_mean = statistics.fmean(getattr(r, attr) for r in ok) if ok else float("nan")
        count = replica[f"{key}_count"]
        replica_mean = replica[f"{key}_sum"] / count if count else float("nan")
        out[f"{key}_mean_ms"] = 1000 * client_mean
        out[f"replica_{key}_mean_ms"] = 1000 * replica_mean
        out[f"hop_{key}_mean_ms"] = 1000 * (client_mean - replica_mean)
    return out


def overhead_histograms(metrics_text: str) -> dict[str, dict[str, Any]]:
    """The gateway's own overhead histogram (corral_gateway_overhead_seconds) per part, all models
    together: `bounds` (the finite bucket bounds, s), `counts` (cumulative, one per bound), `count`
    and `sum_s`. A gateway without the histogram gives empty ones."""
    out: dict[str, dict[str, Any]] = {}
    buckets: dict[str, dict[float, float]] = {part: {} for part in OVERHEAD_PARTS}
    totals = {part: {"count": 0.0, "sum_s": 0.0} for part in OVERHEAD_PARTS}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != OVERHEAD_SECONDS:
            continue
        for sample in family.samples:
            part = sample.labels.get("part", "")
            if part not in totals:
                continue
            suffix = sample.name.removeprefix(OVERHEAD_SECONDS)
            if suffix == "_bucket" and sample.labels["le"] != "+Inf":
                le = float(sample.labels["le"])
                buckets[part][le] = buckets[part].get(le, 0.0) + sample.value
            elif suffix == "_count":
                totals[part]["count"] += sample.value
            elif suffix == "_sum":
                totals[part]["sum_s"] += sample.value
    for part in OVERHEAD_PARTS:
        bounds = sorted(buckets[part])
        counts = [buckets[part][b] for b in bounds]
        out[part] = {"bounds": bounds, "counts": counts, **totals[part]}
    return out


def collector_totals(metrics_text: str, histogram: str = GC_PAUSE_SECONDS) -> dict[str, float]:
    """From a collector-pause histogram (the gateway's unless `histogram` names the engine's):
    `gc_s` (every pass's seconds), `gc_full_passes` and `gc_full_s` (generation 2's count and
    seconds), cumulative."""
    out = {"gc_s": 0.0, "gc_full_passes": 0.0, "gc_full_s": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != histogram:
            continue
        for sample in family.samples:
            is_full = sample.labels.get("generation") == "2"
            if sample.name.endswith("_sum"):
                out["gc_s"] += sample.value
                out["gc_full_s"] += sample.value if is_full else 0.0
            elif sample.name.endswith("_count") and is_full:
                out["gc_full_passes"] += sample.value
    return out


def overhead_change(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the histograms gained between two scrapes: over one arm."""
    return _combine(after, before, -1.0)


def overhead_total(arms: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Several arms' gains in one histogram per part."""
    total: dict[str, Any] = {}
    for histograms in arms:
        total = _combine(histograms, total, 1.0)
    return total


def _combine(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]], sign: float) -> dict[str, Any]:
    """a + sign * b, part by part (a part missing from `b` counts as empty)."""
    out = {}
    for part, h in a.items():
        other = b.get(part) or {"counts": [0.0] * len(h["counts"]), "count": 0.0, "sum_s": 0.0}
        out[part] = {
            "bounds": h["bounds"],
            "counts": [x + sign * y for x, y in zip(h["counts"], other["counts"], strict=True)],
            "count": h["count"] + sign * other["count"],
            "sum_s": h["sum_s"] + sign * other["sum_s"],
        }
    return out


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float], count: float) -> float:
    """Prometheus' histogram_quantile on one histogram: linear within the bucket the rank falls in
    (the first bucket from 0); past the last finite bound, that bound. NaN when empty."""
    if count <= 0:
        return float("nan")
    rank = q * count
    lower, below = 0.0, 0.0
    for upper, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            inside = cumulative - below
            return upper if inside <= 0 else lower + (upper - lower) * (rank - below) / inside
        lower, below = upper, cumulative
    return lower


def overhead_figures(histograms: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per part: requests observed, the median (bucket-interpolated, so good to its bucket's width)
    and the mean (exact: the histogram's sum over its count), in milliseconds."""
    out: dict[str, float] = {}
    for part in OVERHEAD_PARTS:
        h = histograms.get(part)
        count = h["count"] if h is not None else 0.0
        out[f"overhead_{part}_count"] = count
        median = histogram_quantile(0.5, h["bounds"], h["counts"], count) if h is not None else math.nan
        out[f"overhead_{part}_p50_ms"] = 1000 * median
        out[f"overhead_{part}_mean_ms"] = 1000 * h["sum_s"] / count if h is not None and count else math.nan
    return out


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def paired(
    rounds: Sequence[dict[str, dict[str, Any]]], arm: str = "gateway", idle_cores: float = 0.0
) -> dict[str, Any]:
    """Per round, `arm` minus direct for every latency figure and `arm` / direct for throughput;
    the medians over rounds with their interquartile ranges. The gateway's CPU per request is the
    median over its arms, as measured and less what it spends idle (`idle_cores`: load polls and
    gauges, which a fleet pays with or without traffic)."""
    out: dict[str, Any] = {"num_rounds": len(rounds)}
    for key, _, _ in LATENCY_KEYS:
        q1, median, q3 = _quartiles([r[arm][key] - r["direct"][key] for r in rounds])
        out.update({f"added_{key}": median, f"added_{key}_q1": q1, f"added_{key}_q3": q3})
        out[f"direct_{key}"] = statistics.median(r["direct"][key] for r in rounds)
        out[f"via_{key}"] = statistics.median(r[arm][key] for r in rounds)
    for key in ("hop_ttft_mean_ms", "hop_e2el_mean_ms"):
        if all(key in r[arm] and key in r["direct"] for r in rounds):
            q1, median, q3 = _quartiles([r[arm][key] - r["direct"][key] for r in rounds])
            out.update({f"added_{key}": median, f"added_{key}_q1": q1, f"added_{key}_q3": q3})
            out[f"direct_{key}"] = statistics.median(r["direct"][key] for r in rounds)
    q1, median, q3 = _quartiles([r[arm]["output_tok_s"] / r["direct"]["output_tok_s"] for r in rounds])
    out.update(throughput_ratio=median, throughput_ratio_q1=q1, throughput_ratio_q3=q3)
    for name, key in (("direct", "direct"), ("via", arm)):
        out[f"{name}_output_tok_s"] = statistics.median(r[key]["output_tok_s"] for r in rounds)
        out[f"{name}_num_errors"] = sum(r[key]["num_errors"] for r in rounds)
        out[f"{name}_num_ok"] = sum(r[key]["num_ok"] for r in rounds)
    via = [r[arm] for r in rounds]
    out["gateway_cores"] = statistics.median(g["gateway_cores"] for g in via)
    out["gateway_cpu_ms_per_request"] = statistics.median(g["gateway_cpu_ms_per_request"] for g in via)
    out["gateway_cpu_us_per_token"] = statistics.median(g["gateway_cpu_us_per_token"] for g in via)
    out["gateway_idle_cores"] = idle_cores
    out["gateway_busy_cpu_ms_per_request"] = statistics.median(
        1000 * (g["gateway_cpu_s"] - idle_cores * g["duration_s"]) / max(1, g["num_ok"]) for g in via
    )
    out["gateway_runqueue_wait_per_cpu_s"] = statistics.median(
        g.get("gateway_runqueue_wait_per_cpu_s", 0.0) for g in via
    )
    for name in ("sim", "client"):
        out[f"{name}_cores_direct"] = statistics.median(r["direct"][f"{name}_cores"] for r in rounds)
        out[f"{name}_cores_via"] = statistics.median(g[f"{name}_cores"] for g in via)
    for key in ("gc_s", "gc_full_passes", "gc_full_s"):  # the gateway's collector over every round
        if all(key in g for g in via):
            out[f"gateway_{key}"] = sum(g[key] for g in via)
    if all("gateway_overhead" in g for g in via):  # every round's requests in one histogram
        out.update(overhead_figures(overhead_total([g["gateway_overhead"] for g in via])))
    return out


def table(levels: Sequence[dict[str, Any]]) -> str:
    """One row per concurrency level and gateway (the one measured, and a baseline if any)."""
    lines = [
        "| streams | replicas | step (ms) | gateway | rounds | direct tok/s | throughput ratio (IQR) "
        "| added TTFT p50 / p99 (ms) | added E2E p50 / p99 (ms) | direct TTFT p50 / E2E p50 (ms) "
        "| added hop TTFT / E2E, mean (ms) | errors direct / via | gateway cores | CPU / request (ms) "
        "| of it busy (ms) | in-process p50 / mean (ms): request; first byte; stream "
        "| collector s: all; full (passes) |",
        "|---:|---:|---:|---|---:|---:|---|---|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for level in levels:
        for arm, s in level["summary"].items():
            lines.append(
                f"| {level['concurrency']} | {level['num_replicas']} | {level['step_ms']:.0f} | {arm} "
                f"| {s['num_rounds']} | {s['direct_output_tok_s']:.0f} "
                f"| {s['throughput_ratio']:.3f}x "
                f"({s['throughput_ratio_q1']:.3f}-{s['throughput_ratio_q3']:.3f}) "
                f"| {s['added_ttft_p50_ms']:+.2f} / {s['added_ttft_p99_ms']:+.1f} "
                f"| {s['added_e2el_p50_ms']:+.2f} / {s['added_e2el_p99_ms']:+.1f} "
                f"| {s['direct_ttft_p50_ms']:.0f} / {s['direct_e2el_p50_ms']:.0f} "
                f"| {_signed(s.get('added_hop_ttft_mean_ms'))} / {_signed(s.get('added_hop_e2el_mean_ms'))} "
                f"| {s['direct_num_errors']} / {s['via_num_errors']} | {s['gateway_cores']:.2f} "
                f"| {s['gateway_cpu_ms_per_request']:.2f} | {s['gateway_busy_cpu_ms_per_request']:.2f} "
                f"| {_overhead_cell(s)} | {_collector_cell(s)} |"
            )
    return "\n".join(lines)


def _overhead_cell(summary: dict[str, Any]) -> str:
    """The gateway's own median (bucket-interpolated) and mean per part; "-" where it reported none."""
    cells = []
    for part in OVERHEAD_PARTS:
        if not summary.get(f"overhead_{part}_count"):
            cells.append("-")
            continue
        median, mean = summary[f"overhead_{part}_p50_ms"], summary[f"overhead_{part}_mean_ms"]
        cells.append(f"{median:.3f} / {mean:.3f}")
    return "; ".join(cells)


def _collector_cell(summary: dict[str, Any]) -> str:
    """The gateway's collector over the counted rounds; "-" from a gateway without the histogram."""
    if "gateway_gc_s" not in summary:
        return "-"
    full = f"{summary['gateway_gc_full_s']:.2f} ({summary['gateway_gc_full_passes']:.0f})"
    return f"{summary['gateway_gc_s']:.2f}; {full}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def plot(levels: Sequence[dict[str, Any]], path: Path) -> None:
    """Per level, each round's added median and p99 TTFT and E2E (gateway minus direct)."""
    if not levels:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(levels), figsize=(6 * len(levels), 4), squeeze=False)
    for ax, level in zip(axes[0], levels, strict=True):
        arms = list(level["summary"])
        for j, arm in enumerate(arms):
            for i, (key, _, _) in enumerate(LATENCY_KEYS):
                x = i + 0.3 * (j - (len(arms) - 1) / 2)
                diffs = [r[arm][key] - r["direct"][key] for r in level["rounds"]]
                ax.scatter([x] * len(diffs), diffs, color=f"C{j}", alpha=0.6, label=arm if i == 0 else None)
                ax.hlines(statistics.median(diffs), x - 0.12, x + 0.12, color=f"C{j}")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.axhline(2.0, color="red", linewidth=0.8, linestyle="--", label="2 ms target")
        ax.set_xticks(range(len(LATENCY_KEYS)), [key.removesuffix("_ms") for key, _, _ in LATENCY_KEYS])
        ax.set_ylabel("through the gateway minus direct (ms), per round")
        ratios = ", ".join(f"{arm} {s['throughput_ratio']:.3f}x" for arm, s in level["summary"].items())
        ax.set_title(
            f"{level['concurrency']} streams, {level['num_replicas']} replicas: {ratios}", fontsize=9
        )
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
