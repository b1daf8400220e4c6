"""The level-triggered reconcile and the autoscaling step, composed from pure parts and kube.py.

reconcile(): parse spec -> render desired objects -> server-side apply -> prune -> observe ->
compute status -> patch status -> return Events. Idempotent: running it twice changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from corral_operator import autoscaler, labels, render
from corral_operator import status as status_mod
from corral_operator.autoscaler import Decision, Load, State
from corral_operator.kube import SERVICE_MONITOR_CRD, Forbidden, Invalid, Kube
from corral_operator.metrics import MetricsSource, PodTarget
from corral_operator.spec import LLMDeploymentSpec, SpecError, parse_spec
from corral_operator.status import Event, Observed

log = logging.getLogger(__name__)
Obj = dict[str, Any]
PRUNABLE_KINDS = ("PodDisruptionBudget", "ServiceMonitor")  # Deployment and Service always exist
CRD_CACHE_S = 60.0


@dataclass
class Context:
    """Shared by all handlers: the API, the metrics source, a little cached discovery."""

    kube: Kube
    metrics: MetricsSource | None = None
    _sm_checked_at: float = -1e9
    _has_sm: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def has_service_monitor_crd(self, now_s: float) -> bool:
        with self._lock:
            if now_s - self._sm_checked_at > CRD_CACHE_S:
                self._has_sm = self.kube.crd_exists(SERVICE_MONITOR_CRD)
                self._sm_checked_at = now_s
            return self._has_sm


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Obj
    events: list[Event]
    spec_error: str | None = None
    apply_error: str | None = None


def rfc3339(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def parse_time(value: str | None) -> float | None:
    """RFC 3339 UTC ('2026-01-01T00:00:00Z', fractions allowed) or epoch seconds; None if neither."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
    except ValueError:
        log.warning("ignoring unparseable time %r", value)
        return None


def owner_of(body: Mapping[str, Any]) -> render.Owner:
    meta = body["metadata"]
    return render.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def ready_targets(pods: list[Obj], port: int) -> list[PodTarget]:
    out = []
    for pod in pods:
        st = pod.get("status", {})
        is_ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or ()
        )
        if is_ready and st.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            out.append(PodTarget(pod["metadata"]["name"], st["podIP"], port))
    return out


def _prune(kube: Kube, owner: render.Owner, desired: list[Obj], kinds: tuple[str, ...]) -> list[str]:
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
    pruned = []
    for kind in kinds:
        for obj in kube.list(kind, owner.namespace, labels.managed(owner.name)):
            meta = obj["metadata"]
            is_ours = any(ref.get("uid") == owner.uid for ref in meta.get("ownerReferences") or ())
            if (
                is_ours
                and (kind, meta["name"]) not in wanted
                and kube.delete(kind, owner.namespace, meta["name"], meta["uid"])
            ):
                pruned.append(f"{kind}/{meta['name']}")
    return pruned


def _apply_all(
    ctx: Context, owner: render.Owner, spec: LLMDeploymentSpec, now_s: float
) -> tuple[str | None, list[str]]:
    has_sm = ctx.has_service_monitor_crd(now_s)
    desired = render.desired_objects(owner, spec, has_service_monitor_crd=has_sm)
    try:
        for obj in desired:
            ctx.kube.apply(obj)
    except (Invalid, Forbidden) as e:
        return f"applying {obj['kind']}/{owner.name} failed: {e.message}", []
    kinds = PRUNABLE_KINDS if has_sm else PRUNABLE_KINDS[:1]
    return None, _prune(ctx.kube, owner, desired, kinds)


def _status_changed(previous: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    def strip(st: Mapping[str, Any]) -> Obj:
        # None deletes a field in a merge patch, so a None and an absent field are the same state.
        out = {k: v for k, v in st.items() if k in new and v is not None}
        if isinstance(out.get("load"), dict):
            out["load"] = {k: v for k, v in out["load"].items() if k != "observedAt"}
        return out

    return strip(previous) != strip(new)


def reconcile(
    ctx: Context,
    body: Mapping[str, Any],
    *,
    load: Load | None = None,
    is_load_known: bool = False,
    now_s: float | None = None,
    apply: bool = True,
) -> Outcome:
    """Apply the desired state and refresh status; with apply=False only refresh status."""
    now_s = time.time() if now_s is None else now_s
    owner = owner_of(body)
    previous: Obj = dict(body.get("status") or {})
    generation = int(body["metadata"].get("generation", 0))
    raw_spec = body.get("spec") or {}
    base = Observed(
        name=owner.name,
        generation=generation,
        desired_replicas=0,
        selector=labels.selector_string(owner.name),
        endpoint=previous.get("endpoint"),
        previous=previous,
        is_refresh_only=not apply,
    )
    try:
        spec = parse_spec(raw_spec)
        apply_error, pruned = _apply_all(ctx, owner, spec, now_s) if apply else (None, [])
    except SpecError as e:
        raw_replicas = raw_spec.get("replicas")
        replicas = raw_replicas if isinstance(raw_replicas, int) else 0
        obs = dataclasses.replace(base, desired_replicas=replicas, spec_error=str(e))
        return _finish(ctx, owner, obs, previous, now_s, load=None, is_load_known=False)
    missing_pvc = None
    pvc = spec.model.source.pvc
    if pvc is not None and ctx.kube.get("PersistentVolumeClaim", owner.namespace, pvc.claim_name) is None:
        missing_pvc = pvc.claim_name
    obs = dataclasses.replace(
        base,
        desired_replicas=spec.replicas,
        endpoint=render.endpoint_url(owner, spec),
        is_autoscaled=spec.autoscaling is not None,
        deployment=ctx.kube.get("Deployment", owner.namespace, owner.name),
        pods=ctx.kube.list("Pod", owner.namespace, labels.selector_string(owner.name)),
        missing_pvc=missing_pvc,
        apply_error=apply_error,
        load=load,
    )
    outcome = _finish(ctx, owner, obs, previous, now_s, load=load, is_load_known=is_load_known)
    if pruned:
        log.info("%s/%s: pruned %s", owner.namespace, owner.name, ", ".join(pruned))
        gone = Event("Normal", "Pruned", f"deleted {', '.join(pruned)}: the spec no longer asks for it")
        outcome = dataclasses.replace(outcome, events=[*outcome.events, gone])
    return outcome


def _finish(
    ctx: Context,
    owner: render.Owner,
    obs: Observed,
    previous: Obj,
    now_s: float,
    *,
    load: Load | None,
    is_load_known: bool,
) -> Outcome:
    new_status = status_mod.compute(obs, rfc3339(now_s))
    if not is_load_known:
        new_status.pop("load")  # keep what the last metrics tick saw
    if _status_changed(previous, new_status):
        ctx.kube.patch_status(owner.namespace, owner.name, new_status)
        summary = " ".join(f"{c['type']}={c['status']}({c['reason']})" for c in new_status["conditions"])
        log.info("%s/%s: status updated: %s", owner.namespace, owner.name, summary)
    events = status_mod.transitions(previous.get("conditions") or (), new_status["conditions"])
    return Outcome(new_status, events, spec_error=obs.spec_error, apply_error=obs.apply_error)


@dataclass(frozen=True, slots=True)
class ScaleOutcome:
    load: Load | None
    is_load_known: bool
    state: State
    decision: Decision | None = None
    event: Event | None = None


def seed_state(status: Mapping[str, Any]) -> State:
    """Initial autoscaler memory after a (re)start, from what status recorded."""
    replicas = status.get("replicas")
    zeroed = parse_time(status.get("lastScaleTime")) if replicas == 0 else None
    return State(last_active_s=parse_time(status.get("lastActiveTime")), zeroed_at_s=zeroed)


def autoscale(
    ctx: Context, body: Mapping[str, Any], state: State, *, now_s: float, scrape: bool
) -> ScaleOutcome:
    """Read load (when `scrape`), decide replicas, write spec.replicas through the scale subresource."""
    owner = owner_of(body)
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError:
        return ScaleOutcome(None, False, state)
    load, is_known = None, False
    if scrape and ctx.metrics is not None and spec.replicas > 0:
        pods = ctx.kube.list("Pod", owner.namespace, labels.selector_string(owner.name))
        targets = ready_targets(pods, spec.engine.port)
        load, is_known = (ctx.metrics.load(owner.namespace, owner.name, targets) if targets else None), True
    if spec.autoscaling is None:
        return ScaleOutcome(load, is_known, state)
    wake = (body["metadata"].get("annotations") or {}).get(labels.WAKE_ANNOTATION)
    policy = autoscaler.Policy.from_spec(spec.autoscaling)
    decision = autoscaler.decide(policy, state, spec.replicas, load, now_s, parse_time(wake))
    event = None
    if decision.replicas != spec.replicas:
        ctx.kube.patch_replicas(owner.namespace, owner.name, decision.replicas)
        ctx.kube.patch_status(owner.namespace, owner.name, {"lastScaleTime": rfc3339(now_s)})
        event = Event(
            "Normal", "Scaled", f"replicas {spec.replicas} -> {decision.replicas}: {decision.reason}"
        )
    active = decision.state.last_active_s
    if active is not None and active != state.last_active_s and (active - (state.last_active_s or 0)) >= 30:
        ctx.kube.patch_status(owner.namespace, owner.name, {"lastActiveTime": rfc3339(active)})
    return ScaleOutcome(load, is_known, decision.state, decision, event)
