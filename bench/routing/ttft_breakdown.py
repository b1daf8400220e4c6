"""Where a simulated request's time to first token goes, against its floor (`ttft_floor`): the
gateway's queue, the step in flight when it reached its replica, the engine's queue, and the steps
that computed its prompt, split into its own chunks alone, what decoding sequences and other
prompts' chunks in the same steps added, and what its replica lacked of the floor's cache.

    TTFT = gateway queue + step in flight + engine queue + own prefill + decodes + other prefills
    own prefill = floor + cache loss

`Tracer` is fed by `des.FleetSim` (only when asked: it walks every step's batch); `breakdown`
summarizes the counted requests, all of them and the tail at or above the p99 TTFT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.sampling_params import SamplingParams
from corral_engine.sim.engine import SimEngine, SimStep
from corral_engine.sim.perf_model import StepShape

from bench.routing.ttft_floor import Floor


@dataclass(slots=True)
class RequestTrace:
    replica: int
    dispatch_s: float
    step_free_s: float  # when the step in flight at dispatch ended (dispatch_s on an idle replica)
    num_prompt_tokens: int
    num_cached_at_dispatch: int  # prompt tokens its replica held when it was sent there
    num_best_cached: int  # the most any replica held then
    context_tokens: int  # its replica's running sequences' tokens at dispatch: KV each step reads
    fleet_context_tokens: float  # the mean replica's, from each replica's last poll
    num_waiting_at_dispatch: int  # its replica's engine queue then
    num_inflight_prefill_tokens: int  # prompt tokens the step in flight computes (tokens - sequences)
    first_scheduled_s: float | None = None
    num_cached_tokens: int = 0  # what its first scheduling found
    own_s: float = 0.0  # its chunks as steps of their own
    decodes_s: float = 0.0  # added by decoding sequences in its steps
    prefills_s: float = 0.0  # added by other prompts' chunks in its steps
    num_steps: int = 0


class Tracer:
    def __init__(self, engines: Sequence[SimEngine]) -> None:
        self.engines = engines
        self.traces: dict[str, RequestTrace] = {}
        self._prefilling: list[dict[str, RequestTrace]] = [{} for _ in engines]
        self._context = [0.0] * len(engines)

    def on_poll(self, i: int) -> None:
        self._context[i] = float(_context_tokens(self.engines[i]))

    def on_dispatch(
        self,
        request_id: str,
        prompt: list[int],
        i: int,
        now_s: float,
        step: SimStep | None,
        step_end_s: float,
    ) -> None:
        """Before the request is added to engine `i` (`step`: in flight, ending at `step_end_s`)."""
        probe = self.engines[i].make_request(request_id, prompt, SamplingParams(max_tokens=1)).seqs[0]
        block = self.engines[i].block_manager.block_size
        held = [len(e.block_manager.match_prefix(probe)) * block for e in self.engines]
        trace = RequestTrace(
            replica=i,
            dispatch_s=now_s,
            step_free_s=max(now_s, step_end_s),
            num_prompt_tokens=len(prompt),
            num_cached_at_dispatch=held[i],
            num_best_cached=max(held),
            context_tokens=_context_tokens(self.engines[i]),
            fleet_context_tokens=sum(self._context) / len(self._context),
            num_waiting_at_dispatch=self.engines[i].scheduler.num_waiting,
            num_inflight_prefill_tokens=0 if step is None else step.shape.num_tokens - step.shape.num_seqs,
        )
        self.traces[request_id] = trace
        self._prefilling[i][request_id] = trace

    def on_step(self, i: int, step: SimStep, now_s: float) -> None:
        """A step begun on engine `i`: charge it to the prompts it computes that have no token yet."""
        prefilling = self._prefilling[i]
        if not prefilling:
            return
        own: list[tuple[RequestTrace, ScheduledSeq]] = []
        decodes: list[ScheduledSeq] = []
        for s in step.scheduled.scheduled:
            trace = prefilling.get(s.seq.request.request_id)
            if trace is not None:
                own.append((trace, s))
            elif s.num_new_tokens == 1 and s.start >= s.seq.num_prompt_tokens:
                decodes.append(s)
        if not own:
            return
        profile = self.engines[i].profile
        batch = StepShape.of(decodes)
        for trace, s in own:
            if trace.first_scheduled_s is None:
                trace.first_scheduled_s = now_s
                trace.num_cached_tokens = s.start
            alone = StepShape.of([s])
            with_decodes = StepShape(
                alone.num_tokens + batch.num_tokens,
                alone.num_seqs + batch.num_seqs,
                alone.num_kv_tokens + batch.num_kv_tokens,
                alone.num_attn_pairs + batch.num_attn_pairs,
            )
            own_s = profile.step_time_s(alone)
            decodes_s = profile.step_time_s(with_decodes) - own_s
            trace.own_s += own_s
            trace.decodes_s += decodes_s
            trace.prefills_s += step.duration_s - own_s - decodes_s
            trace.num_steps += 1

    def on_first_token(self, i: int, request_id: str) -> None:
        self._prefilling[i].pop(request_id, None)


def _context_tokens(engine: SimEngine) -> int:
    return sum(seq.num_tokens for seq in engine.scheduler.running)


# Per request: the components of its TTFT (seconds), then what explains them.
COMPONENTS = ("floor", "cache_loss", "gateway_queue", "step_in_flight", "engine_queue", "decodes", "prefills")


def components(arrival_s: float, first_token_s: float, trace: RequestTrace, floor: Floor) -> dict[str, float]:
    """TTFT split so that the parts add up; `other` is what no step of its own covers (a
    preemption while its prompt was being computed), zero otherwise."""
    first_scheduled_s = trace.first_scheduled_s if trace.first_scheduled_s is not None else first_token_s
    parts = {
        "floor": floor.warm_s,
        "cache_loss": trace.own_s - floor.warm_s,
        "gateway_queue": trace.dispatch_s - arrival_s,
        "step_in_flight": trace.step_free_s - trace.dispatch_s,
        "engine_queue": first_scheduled_s - trace.step_free_s,
        "decodes": trace.decodes_s,
        "prefills": trace.prefills_s,
    }
    parts["other"] = first_token_s - arrival_s - sum(parts.values())
    return parts


def breakdown(
    outcomes: Mapping[str, Any], traces: Mapping[str, RequestTrace], floors: Mapping[str, Floor]
) -> dict[str, Any]:
    """Mean components (ms) of the counted requests, and of those at or above the p99 TTFT; with
    their cached tokens (the floor's, at dispatch on the chosen replica and the best one, found)
    and how loaded their replica was against the fleet's mean."""
    rows = []
    for o in outcomes.values():
        if not o.is_counted or o.first_token_s is None or o.request_id not in traces:
            continue
        trace = traces[o.request_id]
        floor = floors[o.request_id]
        parts = components(o.arrival_s, o.first_token_s, trace, floor)
        rows.append(
            parts
            | {
                "ttft": o.first_token_s - o.arrival_s,
                "prompt_tokens": trace.num_prompt_tokens,
                "floor_cached_tokens": floor.num_cached_tokens,
                "best_cached_tokens": trace.num_best_cached,
                "dispatch_cached_tokens": trace.num_cached_at_dispatch,
                "cached_tokens": trace.num_cached_tokens,
                "context_tokens": trace.context_tokens,
                "fleet_context_tokens": trace.fleet_context_tokens,
                "engine_waiting": trace.num_waiting_at_dispatch,
                "inflight_prefill_tokens": trace.num_inflight_prefill_tokens,
                "steps": trace.num_steps,
                "is_routed_off_cache": trace.num_best_cached > trace.num_cached_at_dispatch,
                "is_evicted": trace.num_cached_tokens < trace.num_cached_at_dispatch,
            }
        )
    if not rows:
        return {}
    p99 = float(np.percentile([r["ttft"] for r in rows], 99))
    tail = [r for r in rows if r["ttft"] >= p99]
    return {"p99_ttft_ms": 1000 * p99, "all": _means(rows), "tail": _means(tail), "num_tail": len(tail)}


def _means(rows: list[dict[str, Any]]) -> dict[str, float]:
    seconds = {*COMPONENTS, "other", "ttft"}
    out = {}
    for key in rows[0]:
        mean = float(np.mean([float(r[key]) for r in rows]))
        out[f"{key}_ms" if key in seconds else key] = 1000 * mean if key in seconds else mean
    return out


def format_breakdown(b: Mapping[str, Any]) -> str:
    """One line per group: the mean components in ms, then the cache and load figures."""
    lines = []
    for group in ("all", "tail"):
        m = b[group]
        parts = " + ".join(f"{k.replace('_', ' ')} {m[k + '_ms']:.1f}" for k in (*COMPONENTS, "other"))
        lines.append(
            f"{group:>4}: TTFT {m['ttft_ms']:.1f} = {parts}; prompt {m['prompt_tokens']:.0f} tok, cached "
            f"floor/best/sent/found {m['floor_cached_tokens']:.0f}/{m['best_cached_tokens']:.0f}/"
            f"{m['dispatch_cached_tokens']:.0f}/{m['cached_tokens']:.0f}, off cache "
            f"{100 * m['is_routed_off_cache']:.0f}%, evicted {100 * m['is_evicted']:.0f}%, running context "
            f"{m['context_tokens'] / 1000:.0f}k tok (fleet mean {m['fleet_context_tokens'] / 1000:.0f}k), "
            f"engine queue {m['engine_waiting']:.2f}, prompt tokens in the step in flight "
            f"{m['inflight_prefill_tokens']:.0f}, steps {m['steps']:.2f}"
        )
    return "\n".join(lines)
