"""The autoscaling step of a tick: observe the ready pods' load, ask the pure autoscaler, scale.

Writes spec.replicas through the scale subresource (as HPA or `kubectl scale` would); the status
fields it records (lastScaleTime, lastActiveTime) go into the tick's one status patch (reconcile.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corral_engine import wire

from corral_operator import autoscaler, labels
from corral_operator.autoscaler import Decision, Load, State
from corral_operator.context import Context
from corral_operator.metrics import PodTarget
from corral_operator.render import Owner
from corral_operator.spec import LLMDeploymentSpec, SpecError, parse_spec
from corral_operator.status import Event
from corral_operator.timestamps import parse_time, rfc3339

# lastActiveTime is rewritten once per this much activity, not on every busy tick.
ACTIVE_TIME_STEP_S = 30.0


@dataclass(frozen=True, slots=True)
class ScaleOutcome:
    load: Load | None
    is_load_known: bool
    state: State
    decision: Decision | None = None
    event: Event | None = None
    status: dict[str, str] = field(default_factory=dict)  # fields for the tick's status patch
    patched: bool = False  # spec.replicas was written


def seed_state(status: Mapping[str, Any]) -> State:
    """Initial autoscaler memory after a (re)start, from what status recorded."""
    replicas = status.get("replicas")
    zeroed = parse_time(status.get("lastScaleTime")) if replicas == 0 else None
    return State(last_active_s=parse_time(status.get("lastActiveTime")), zeroed_at_s=zeroed)


def ready_targets(pods: list[dict[str, Any]], port: int) -> list[PodTarget]:
    """The pods that serve (the same rule the gateway routes by), as scrape targets."""
    return [
        PodTarget(pod["metadata"]["name"], pod["status"]["podIP"], port)
        for pod in pods
        if wire.is_pod_serving(pod)
    ]


def observe_load(ctx: Context, owner: Owner, spec: LLMDeploymentSpec) -> tuple[Load | None, bool]:
    """(load, is_known): known means the ready pods were asked (none ready is a known 'no load'),
    or the model is at zero (the last load seen before it went down is not its load now)."""
    if ctx.metrics is None:
        return None, False
    if spec.replicas == 0:
        return None, True
    pods = ctx.kube.list("Pod", owner.namespace, labels.selector_string(owner.name))
    targets = ready_targets(pods, spec.engine.port)
    return (ctx.metrics.load(owner.namespace, owner.name, targets) if targets else None), True


def autoscale(
    ctx: Context, body: Mapping[str, Any], state: State, *, now_s: float, scrape: bool
) -> ScaleOutcome:
    """Read load (when `scrape`), decide replicas, write spec.replicas when they change."""
    owner = Owner.from_body(body)
    try:
        spec = parse_spec(ctx.known_spec(body.get("spec") or {}, now_s))
    except SpecError:
        return ScaleOutcome(None, False, state)
    load, is_known = observe_load(ctx, owner, spec) if scrape else (None, False)
    if spec.autoscaling is None or not spec.autoscaling.is_builtin:
        return ScaleOutcome(load, is_known, state)  # fixed, or an HPA / KEDA owns spec.replicas
    wake = (body["metadata"].get("annotations") or {}).get(labels.WAKE_ANNOTATION)
    policy = autoscaler.Policy.from_spec(spec.autoscaling)
    decision = autoscaler.decide(policy, state, spec.replicas, load, now_s, parse_time(wake))
    status: dict[str, str] = {}
    event = None
    if decision.replicas != spec.replicas:
        ctx.kube.patch_replicas(owner.namespace, owner.name, decision.replicas)
        status["lastScaleTime"] = rfc3339(now_s)
        event = Event(
            "Normal", "Scaled", f"replicas {spec.replicas} -> {decision.replicas}: {decision.reason}"
        )
    active, before = decision.state.last_active_s, state.last_active_s
    if active is not None and active != before and active - (before or 0) >= ACTIVE_TIME_STEP_S:
        status["lastActiveTime"] = rfc3339(active)
    return ScaleOutcome(load, is_known, decision.state, decision, event, status, patched=event is not None)
