"""Pure autoscaling decisions: desired replicas from waiting requests and KV usage.

HPA-style: a raw recommendation per tick, then stabilization windows (scale up to the lowest
recommendation of the up window, down to the highest of the down window), min/max bounds, scale to
zero after an idle time (minReplicas 0) and back on a wake request. No I/O; time is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from corral_operator.spec import AutoscalingSpec

TOLERANCE = 0.1  # ignore recommendations within 10% of the current size (no flapping on noise)


@dataclass(frozen=True, slots=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_waiting_per_replica: float
    target_kv_usage_ratio: float
    scale_up_window_s: float
    scale_down_window_s: float
    idle_to_zero_s: float

    @classmethod
    def from_spec(cls, spec: AutoscalingSpec) -> Policy:
        return cls(
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            target_waiting_per_replica=spec.target_waiting_per_replica,
            target_kv_usage_ratio=spec.target_kv_usage,
            scale_up_window_s=spec.scale_up_stabilization_seconds,
            scale_down_window_s=spec.scale_down_stabilization_seconds,
            idle_to_zero_s=spec.scale_to_zero_idle_seconds,
        )


@dataclass(frozen=True, slots=True)
class Load:
    """Load summed (waiting, running) or averaged (KV) over the replicas that reported it;
    `num_unreported`: ready replicas asked that did not answer (a busy engine may be too slow to)."""

    num_waiting: float
    num_running: float
    kv_usage_ratio: float
    num_reporting: int
    num_unreported: int = 0
    num_finished: float = 0.0  # requests finished so far (the engines' counters, summed)

    @property
    def is_idle(self) -> bool:
        """Nothing running or waiting on any ready replica (a silent one may be busy)."""
        return self.num_waiting <= 0 and self.num_running <= 0 and self.num_unreported == 0


@dataclass(frozen=True, slots=True)
class State:
    """What the autoscaler remembers between ticks (in memory; losing it only delays decisions)."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time_s, replicas), oldest first
    last_active_s: float | None = None
    zeroed_at_s: float | None = None
    last_replicas: int | None = None
    history_start_s: float | None = None  # before this, the down window assumes the current size
    num_finished_seen: float | None = None  # Load.num_finished at the last scrape
    woken_by_s: float | None = None  # the wake stamp that last brought it up from zero (served)


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str
    state: State = field(default_factory=State)


def recommend(policy: Policy, current: int, load: Load) -> int:
    """Raw replicas for this load, before windows and bounds. As an HPA does with missing metrics,
    a replica that did not report counts as idle on the way up and as loaded at the targets on the
    way down: replicas too busy to answer a scrape in time must not get the fleet shrunk."""
    n = max(load.num_reporting, 1)
    by_queue = math.ceil(load.num_waiting / policy.target_waiting_per_replica)
    by_kv = math.ceil(n * load.kv_usage_ratio / policy.target_kv_usage_ratio)
    busy_floor = 0 if load.is_idle else 1
    raw = max(by_queue, by_kv, busy_floor)
    if raw < current and load.num_unreported > 0:
        # Each silent replica at the targets adds exactly one replica to both recommendations.
        raw = min(current, max(by_queue, by_kv) + load.num_unreported)
    if current > 0 and abs(raw / current - 1.0) <= TOLERANCE:
        return current
    return raw


def _bounded(policy: Policy, replicas: int) -> int:
    return min(max(replicas, policy.min_replicas, 1), policy.max_replicas)


def _out_of_bounds(policy: Policy, replicas: int) -> str:
    """Why _bounded moved `replicas` (the Event says so, rather than the load's story)."""
    if replicas > policy.max_replicas:
        return f"{replicas} is above maxReplicas {policy.max_replicas}"
    return f"{replicas} is below minReplicas {policy.min_replicas}"


def decide(
    policy: Policy,
    state: State,
    current: int,
    load: Load | None,
    now_s: float,
    wake_at_s: float | None = None,
) -> Decision:
    """Desired replicas now. `load` is None when no ready replica reported metrics."""
    if current == 0:
        return _decide_at_zero(policy, state, now_s, wake_at_s)
    woke_up = state.last_replicas == 0 or state.last_active_s is None
    last_active = now_s if woke_up or _is_busy(state, load) else state.last_active_s
    start = state.history_start_s if state.history_start_s is not None and not woke_up else now_s
    finished = state.num_finished_seen if load is None else load.num_finished
    state = replace(
        state,
        last_active_s=last_active,
        last_replicas=current,
        history_start_s=start,
        num_finished_seen=finished,
    )
    if load is None:
        held = _bounded(policy, current)
        why = "no load reported; holding" if held == current else _out_of_bounds(policy, current)
        return Decision(held, why, state)
    idle_s = now_s - (last_active if last_active is not None else now_s)
    if policy.min_replicas == 0 and load.is_idle and idle_s >= policy.idle_to_zero_s:
        zeroed = replace(state, recommendations=(), zeroed_at_s=now_s, last_replicas=0, history_start_s=None)
        return Decision(
            0, f"idle for {idle_s:.0f}s (>= {policy.idle_to_zero_s:.0f}s); scaling to zero", zeroed
        )
    raw = _bounded(policy, recommend(policy, current, load))
    horizon = max(policy.scale_up_window_s, policy.scale_down_window_s)
    recs = (*((t, r) for t, r in state.recommendations if now_s - t <= horizon), (now_s, raw))
    state = replace(state, recommendations=recs)
    if raw > current:
        window = [r for t, r in recs if now_s - t <= policy.scale_up_window_s]
        desired = max(current, min(window))
        why = f"load wants {raw} (waiting {load.num_waiting:.0f}, kv {load.kv_usage_ratio:.0%})"
    elif raw < current:
        window = [r for t, r in recs if now_s - t <= policy.scale_down_window_s]
        if now_s - start < policy.scale_down_window_s:
            window.append(current)  # a fresh (or restarted) autoscaler never shrinks before a full window
        desired = min(current, max(window))
        why = f"load wants {raw}; highest in the {policy.scale_down_window_s:.0f}s window is {max(window)}"
    else:
        desired, why = current, "load matches replicas"
    if _bounded(policy, desired) != desired:
        desired, why = _bounded(policy, desired), _out_of_bounds(policy, desired)
    return Decision(desired, why, replace(state, last_replicas=desired))


def _is_busy(state: State, load: Load | None) -> bool:
    """Requests running or waiting now, or finished since the last scrape: a model whose short
    requests all fall between two scrapes leaves the gauges at zero, but not the counter. A counter
    that moved either way (a pod restarted, replicas changed) counts too: staying up is the safe side."""
    if load is None:
        return False
    has_finished = state.num_finished_seen is not None and load.num_finished != state.num_finished_seen
    return not load.is_idle or has_finished


def _decide_at_zero(policy: Policy, state: State, now_s: float, wake_at_s: float | None) -> Decision:
    if state.last_replicas:
        # Someone else scaled it to zero (`kubectl scale --replicas 0`): it went to sleep now, so a
        # wake stamp from before (the annotation stays on the object) is no request to serve.
        state = replace(state, zeroed_at_s=now_s, recommendations=())
    # A wake stamped in the second the model went to zero counts: stamps may have 1 s resolution,
    # and a request arriving while scaling down must not be lost. A stamp that already woke it was
    # served, even when it went back to zero within that second (the gateway stamps anew every 10 s
    # while requests wait, so a request in that same second still gets a replica).
    is_woken = (
        wake_at_s is not None
        and wake_at_s != state.woken_by_s
        and (state.zeroed_at_s is None or wake_at_s >= math.floor(state.zeroed_at_s))
    )
    if is_woken or policy.min_replicas > 0:
        replicas = max(policy.min_replicas, 1)
        reason = "woken by a request" if is_woken else f"below minReplicas {policy.min_replicas}"
        woke = State(
            recommendations=(),
            last_active_s=now_s,
            zeroed_at_s=state.zeroed_at_s,
            last_replicas=replicas,
            woken_by_s=wake_at_s if is_woken else state.woken_by_s,
        )
        return Decision(min(replicas, policy.max_replicas), reason, woke)
    return Decision(0, "scaled to zero; waiting for a wake request", replace(state, last_replicas=0))
