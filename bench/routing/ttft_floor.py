"""The TTFT no routing policy can beat, per request (pure): its prefill alone on an idle replica of
the profile, with every full block that an earlier request computed already in that replica's cache.

A routed request waits for the step in flight, shares its steps with other sequences (which only
lengthens them) and finds at most what earlier requests computed in its replica's cache, so its
TTFT in the simulated fleet is at least this floor; and since every request's TTFT is at least its
floor, so is every percentile of them (the k-th smallest of the TTFTs is at least the k-th smallest
of the floors). `cold` is the same prefill with nothing cached.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from corral_engine.sim.perf_model import Profile, StepShape

from bench.routing.sim_workloads import SimRequest, reply_of


@dataclass(frozen=True, slots=True)
class Floor:
    warm_s: float  # with the longest prefix an earlier request computed
    cold_s: float  # with nothing cached
    num_cached_tokens: int


def prefill_time_s(profile: Profile, num_tokens: int, num_cached: int) -> float:
    """The prompt's uncached tokens in chunks of the step budget, one sequence per step; the step
    that computes the last one samples the first token."""
    start, remaining, total_s = num_cached, num_tokens - num_cached, 0.0
    while remaining > 0:
        new = min(remaining, profile.max_num_batched_tokens)
        total_s += profile.step_time_s(StepShape(new, 1, start + new, new * (start + (new + 1) / 2)))
        start += new
        remaining -= new
    return total_s


def ttft_floors(requests: Iterable[SimRequest], profile: Profile) -> dict[str, Floor]:
    """Per request id. The cache is the union of every earlier request's computed blocks (prompt
    and reply but its last token, as the engine registers them), shared by all replicas and never
    evicted; at least one prompt token is computed (the engine needs its logits)."""
    block = profile.block_size
    seen: set[int] = set()
    floors: dict[str, Floor] = {}
    for r in sorted(requests, key=lambda r: r.arrival_s):
        computed = r.prompt + reply_of(r.prompt, r.output_len)[:-1]
        chain, parent = [], 0
        for i in range(len(computed) // block):
            parent = hash((parent, tuple(computed[i * block : (i + 1) * block])))
            chain.append(parent)
        num_hit = 0
        for h in chain[: (len(r.prompt) - 1) // block]:
            if h not in seen:
                break
            num_hit += 1
        cached = num_hit * block
        warm = prefill_time_s(profile, len(r.prompt), cached)
        floors[r.request_id] = Floor(warm, prefill_time_s(profile, len(r.prompt), 0), cached)
        seen.update(chain)
    return floors
