"""The served phase: W2-shaped requests arriving as a Poisson process, at a few rates, into Corral's
LLMEngine stepped in one loop the way the server's step thread steps it (each output taken when
`step()` hands it back, a step late where the output overlap or async scheduling is on), without
HTTP. Per rate: time to first token, time per output token and end-to-end latency as the engine
delivers them, output tokens/s, and how the step time splits between steps that carry prompt
chunks ("mixed": they run eagerly) and decode-only steps (CUDA graphs on a GPU), each call's time
counted to the batch whose tokens it waited for (`corral_engine.step_clock`: with async scheduling
that is the batch launched by the call before; a call that waits for two, the step before a
sequence's last token, is a "double" step of its own). Under arrival traffic the mixed steps set
every running request's TPOT, which offline throughput hides.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from typing import Any

from corral_engine.sampling_params import SamplingParams
from corral_engine.step_clock import StepClock

from bench.engine.worker_common import warmup_requests
from bench.gpu.context import Run
from bench.gpu.throughput import workload_requests

log = logging.getLogger("gpu")


def served(run: Run, results: dict[str, Any]) -> dict[str, Any]:
    p = run.profile
    model_dir = run.model_dir(p.throughput_preset)
    max_len = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    requests, _ = workload_requests("W2", model_dir, max_len, p.quick_workloads)
    requests = requests[: p.served_requests]
    engine, record = run.engine(model_dir, **run.speed_options())
    engine.generate([prompt for prompt, _ in warmup_requests()], SamplingParams(max_tokens=8))
    out: dict[str, Any] = {
        "preset": p.throughput_preset,
        "workload": "W2",
        "num_requests": len(requests),
        "engine": record,
        "settings": engine.settings.describe(),
        "rates": {},
    }
    for rate in p.served_rates:
        compiled = compiled_variants()
        figures = run_at_rate(engine, requests, rate, seed=0)
        # Kernel variants Triton compiled while requests waited: each one a stalled step.
        figures["kernel_variants_compiled"] = compiled_variants() - compiled
        out["rates"][f"{rate:g}"] = figures
        log.info(
            "served W2 at %g req/s: TTFT p50 %.1f ms p99 %.1f ms, TPOT p50 %.2f ms p99 %.2f ms, %.0f tok/s; "
            "%d mixed steps of %.2f ms, %d decode steps of %.2f ms, %d double of %.2f ms; "
            "%d kernel variants compiled",
            rate,
            figures["ttft_ms"]["p50"],
            figures["ttft_ms"]["p99"],
            figures["tpot_ms"]["p50"],
            figures["tpot_ms"]["p99"],
            figures["output_throughput"],
            figures["steps"]["mixed"]["count"],
            figures["steps"]["mixed"]["mean_ms"],
            figures["steps"]["decode"]["count"],
            figures["steps"]["decode"]["mean_ms"],
            figures["steps"]["double"]["count"],
            figures["steps"]["double"]["mean_ms"],
            figures["kernel_variants_compiled"],
        )
    return out


def compiled_variants() -> int:
    """Triton kernel variants the engine has compiled in this process (0 where it cannot say:
    an engine from before the count, or no Triton)."""
    try:
        from corral_engine.model.triton_attention import compiled_variants as count
    except ImportError:
        return 0
    return count()


def run_at_rate(engine: Any, requests: list[tuple[list[int], int]], rate: float, seed: int) -> dict[str, Any]:
    """Send `requests` (prompt, output length) at Poisson arrivals of `rate` a second, stepping the
    engine between arrivals; latency figures per request and step times by kind."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in requests:
        t += rng.expovariate(rate)
        arrivals.append(t)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    num_tokens: dict[str, int] = {}
    step_ms: dict[str, list[float]] = {"mixed": [], "decode": [], "double": []}
    clock = StepClock()
    sent = 0
    start = time.perf_counter()
    while sent < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while sent < len(requests) and arrivals[sent] <= now:
            prompt, num_out = requests[sent]
            params = SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True)
            engine.add_request(f"served-{rate:g}-{sent}", prompt, params)
            sent += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[sent] - now))
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        # With async scheduling a call waits for the last call's batch: its time is that batch's.
        timed = clock.record(engine.last_schedule, t1 - t0, engine.step_in_flight)
        if timed is not None:
            if len(timed.schedules) > 1:
                kind = "double"
            elif any(s.num_new_tokens - s.num_spec > 1 for s in timed.schedules[0]):
                kind = "mixed"
            else:
                kind = "decode"
            step_ms[kind].append(1000 * timed.seconds)
        for o in outputs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = t1 - start
            last[o.request_id], num_tokens[o.request_id] = t1 - start, n
    ids = [f"served-{rate:g}-{i}" for i in range(len(requests))]
    ttft = [1000 * (first[r] - arrivals[i]) for i, r in enumerate(ids)]
    e2e = [1000 * (last[r] - arrivals[i]) for i, r in enumerate(ids)]
    tpot = [1000 * (last[r] - first[r]) / (num_tokens[r] - 1) for r in ids if num_tokens[r] > 1]
    total_ms = sum(sum(v) for v in step_ms.values())
    return {
        "rate": rate,
        "num_requests": len(requests),
        "ttft_ms": _percentiles(ttft),
        "tpot_ms": _percentiles(tpot),
        "e2e_ms": _percentiles(e2e),
        "output_tokens": sum(num_tokens.values()),
        "output_throughput": sum(num_tokens.values()) / (max(last.values()) - arrivals[0]),
        "steps": {
            kind: {
                "count": len(times),
                "mean_ms": statistics.fmean(times) if times else 0.0,
                "share_of_step_time": sum(times) / total_ms if total_ms else 0.0,
            }
            for kind, times in step_ms.items()
        },
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "mean": statistics.fmean(ordered),
    }
