"""Per-request timings and their aggregation into throughput and latency percentiles (pure)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")  # e2el: end-to-end latency of a request


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times in seconds from when the request was sent."""

    is_success: bool = False
    prompt_len: int = 0  # tokens; the server's usage count when it reported one
    output_len: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between successive streamed chunks
    error: str = ""
    # False for a non-streamed request: its tokens arrive at once, so their pace is unknown.
    is_streamed: bool = True
    # False for an embeddings or rerank request: no tokens are generated, so there is no first
    # token, no pace and no output (its latency is E2E only).
    is_generation: bool = True
    num_inputs: int = 0  # texts or token-id lists an embeddings request sent, documents a rerank's

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens or when the
        response was not streamed (TTFT is then the whole request's, and (E2E - TTFT) is 0)."""
        if self.output_len < 2 or not self.is_streamed:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)


def summarize(values_s: list[float]) -> dict[str, float]:
    """mean / median / p90 / p99 in milliseconds; NaN when there are no values."""
    if not values_s:
        nan = float("nan")
        return {"mean": nan, "median": nan, "p90": nan, "p99": nan}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(arr, PERCENTILES).tolist()
    return {"mean": float(arr.mean()), "median": p50, "p90": p90, "p99": p99}


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-latency-kind samples (seconds) over successful requests."""
    ok = [r for r in results if r.is_success]
    return {
        "ttft": [r.ttft_s for r in ok if r.is_generation],
        "tpot": [t for r in ok if (t := r.tpot_s) is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok],
    }


def aggregate(results: list[RequestResult], duration_s: float, is_generation: bool = True) -> dict[str, Any]:
    """One run's summary with flat keys (e.g. `p99_ttft_ms`, `output_throughput`). Without
    generation (embeddings, rerank) the output figures are None and the inputs are counted."""
    ok = [r for r in results if r.is_success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    summary: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out if is_generation else None,
        "request_throughput": len(ok) * per_s,  # requests/s
        "input_throughput": total_in * per_s,  # tokens/s
        "output_throughput": total_out * per_s if is_generation else None,
        "total_token_throughput": (total_in + total_out) * per_s,
    }
    if not is_generation:
        total_inputs = sum(r.num_inputs for r in ok)
        summary["total_inputs"] = total_inputs
        summary["input_item_throughput"] = total_inputs * per_s  # embedded texts (rerank: documents)/s
    for kind, samples in latency_samples(results).items():
        for stat, value in summarize(samples).items():
            summary[f"{stat}_{kind}_ms"] = value
    errors = Counter(r.error for r in results if not r.is_success)
    summary["errors"] = dict(errors.most_common(5))
    return summary
