"""Where a served run's time to first token went, read from the engine's own Prometheus metrics.

Both engines export vLLM's histograms, so one scrape before and one after a `corral bench` run
splits each request's time to first token on the engine side into its queue time (arrival to first
scheduled) and its prefill time (first scheduled to first token), and counts the engine's steps and
the tokens each computed. What the client saw beyond the engine's TTFT is the HTTP server's.

Means come from `_sum / _count` (exact); quantiles are interpolated inside the histogram's buckets,
so only as fine as its bucket bounds (vLLM's queue-time buckets start at 0.3 s): read them as
"within this bucket", compare the means.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Histogram name -> short key in the summary.
HISTOGRAMS = {
    "vllm:request_queue_time_seconds": "queue_s",
    "vllm:request_prefill_time_seconds": "prefill_s",
    "vllm:time_to_first_token_seconds": "ttft_s",
    "vllm:iteration_tokens_total": "step_tokens",
    # Corral's own (vLLM has no step-duration histogram): the steps' summed wall time, against the
    # run's duration and against the offline run's, says whether served steps ran slower or fewer.
    "corral_engine_step_duration_seconds": "step_s",
    # The garbage collector's passes, all generations (the server's stop-the-world time).
    "corral_engine_gc_pause_seconds": "gc_s",
}
# Histograms read for one label value as well: (name, label, value) -> key.
LABELLED_HISTOGRAMS = {("corral_engine_gc_pause_seconds", "generation", "2"): "gc_full_s"}
COUNTERS = {"vllm:num_preemptions": "preemptions"}

Snapshot = dict[str, Any]  # key -> {"buckets": [(le, cumulative count)], "sum", "count"} or a float


def scrape(base_url: str, timeout_s: float = 10.0) -> Snapshot | None:
    """The engine's histograms and counters now (summed over label sets), None if /metrics fails."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    return parse(text)


def _histogram(samples: list[Any]) -> dict[str, Any]:
    """One histogram's samples summed over their label sets."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for s in samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            total += s.value
        elif s.name.endswith("_count"):
            count += s.value
    return {"buckets": sorted(buckets.items()), "sum": total, "count": count}


def parse(text: str) -> Snapshot:
    snap: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for (name, label, value), key in LABELLED_HISTOGRAMS.items():
            if family.name == name:
                snap[key] = _histogram([s for s in family.samples if s.labels.get(label) == value])
        if family.name in HISTOGRAMS:
            snap[HISTOGRAMS[family.name]] = _histogram(family.samples)
        elif family.name in COUNTERS:
            snap[COUNTERS[family.name]] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return snap


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Linear interpolation inside the bucket holding the q-th observation (Prometheus's rule)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if math.isinf(le):
                return lower_le
            width = cum - lower_count
            return lower_le + (le - lower_le) * ((rank - lower_count) / width if width else 1.0)
        lower_le, lower_count = le, cum
    return None


def delta(before: Snapshot | None, after: Snapshot | None) -> dict[str, Any] | None:
    """What happened between two scrapes: per histogram its count, mean, p50 and p99; counters' increase."""
    if before is None or after is None:
        return None
    out: dict[str, Any] = {}
    for key in (*HISTOGRAMS.values(), *LABELLED_HISTOGRAMS.values()):
        a, b = after.get(key), before.get(key, {"buckets": [], "sum": 0.0, "count": 0.0})
        if a is None:
            continue
        prior = dict(b["buckets"])
        buckets = [(le, cum - prior.get(le, 0.0)) for le, cum in a["buckets"]]
        count = a["count"] - b["count"]
        if count <= 0:
            continue
        out[key] = {
            "count": count,
            "mean": (a["sum"] - b["sum"]) / count,
            "p50": _quantile(buckets, 0.5),
            "p99": _quantile(buckets, 0.99),
        }
    for key in COUNTERS.values():
        if key in after:
            out[key] = after[key] - (before or {}).get(key, 0.0)
    return out


def describe(d: dict[str, Any]) -> str:
    """One line: mean (p99) of queue, prefill and TTFT in ms, steps and mean tokens per step."""

    def ms(key: str) -> str:
        h = d.get(key)
        if not h:
            return f"{key[:-2]} -"
        p99 = f"{h['p99'] * 1e3:.0f}" if h["p99"] is not None else "-"
        return f"{key[:-2]} {h['mean'] * 1e3:.0f} ms (p99 ~{p99})"

    steps = d.get("step_tokens")
    step_text = f"{steps['count']:.0f} steps of {steps['mean']:.0f} tokens" if steps else "steps -"
    step_s = d.get("step_s")
    if step_s:
        step_text += f" in {step_s['count'] * step_s['mean']:.2f} s"
    preempted = f"{d.get('preemptions', 0):.0f} preempted"
    return f"{ms('queue_s')}, {ms('prefill_s')}, {ms('ttft_s')}; {step_text}; {preempted}"
