"""The level-triggered, idempotent reconcile: parse spec -> render -> server-side apply -> prune ->
observe -> compute status -> one status patch (with what the autoscaling step recorded) -> Events.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corral_operator import labels, render
from corral_operator import status as status_mod
from corral_operator.autoscaler import Load
from corral_operator.autoscalers import SCALED_OBJECT_CRD
from corral_operator.context import Context
from corral_operator.engine_command import tensor_parallel_size
from corral_operator.kube import RESOURCES, Conflict, Forbidden, Invalid, Kube
from corral_operator.render import SERVICE_MONITOR_CRD, Owner
from corral_operator.spec import KIND, LLMDeploymentSpec, SpecError, parse_spec
from corral_operator.status import Event, Observed
from corral_operator.timestamps import rfc3339

log = logging.getLogger(__name__)
Obj = dict[str, Any]
# (kind, the CRD it needs): what the spec may stop asking for; Deployment, Service and
# PodDisruptionBudget always exist.
PRUNABLE_KINDS: tuple[tuple[str, str | None], ...] = (
    ("HorizontalPodAutoscaler", None),
    ("ServiceMonitor", SERVICE_MONITOR_CRD),
    ("ScaledObject", SCALED_OBJECT_CRD),
)


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Obj
    events: list[Event]
    spec_error: str | None = None
    apply_error: str | None = None


def _prune(kube: Kube, owner: Owner, desired: list[Obj], kinds: tuple[str, ...]) -> list[str]:
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
    ctx: Context, owner: Owner, spec: LLMDeploymentSpec, now_s: float
) -> tuple[str | None, list[str]]:
    crds = ctx.installed_crds(now_s)
    desired = render.desired_objects(
        owner, spec, crds=crds, monitor_labels=ctx.monitor_labels, monitor_interval=ctx.monitor_interval
    )
    try:
        for obj in desired:
            ctx.kube.apply(obj)
    except (Invalid, Forbidden) as e:
        return f"applying {obj['kind']}/{owner.name} failed: {e.message}", []
    kinds = [kind for kind, crd in PRUNABLE_KINDS if crd is None or crd in crds]
    pruned = _prune(ctx.kube, owner, desired, tuple(kinds))
    if spec.autoscaling is not None and spec.autoscaling.mode == "keda" and SCALED_OBJECT_CRD not in crds:
        return _keda_missing(ctx), pruned
    return None, pruned


def _keda_missing(ctx: Context) -> str:
    if SCALED_OBJECT_CRD in ctx.refused_crds():
        path = RESOURCES["ScaledObject"][0]
        return (
            f"autoscaling.mode keda: the operator may not read API discovery (GET {path} got 403 "
            "Forbidden), so it cannot tell whether KEDA is installed: a permission problem "
            "(every authenticated user may read discovery unless the cluster unbound system:discovery)"
        )
    return f"autoscaling.mode keda needs KEDA: CRD {SCALED_OBJECT_CRD} is not installed"


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
    recorded: Mapping[str, Any] | None = None,
    now_s: float | None = None,
    apply: bool = True,
) -> Outcome:
    """Apply the desired state and refresh status; with apply=False only refresh status.

    `recorded`: status fields another step of the tick recorded (the autoscaler's lastScaleTime,
    lastActiveTime), written in the same status patch.
    """
    now_s = time.time() if now_s is None else now_s
    owner = Owner.from_body(body)
    previous: Obj = dict(body.get("status") or {})
    raw_spec = body.get("spec") or {}
    base = Observed(
        name=owner.name,
        generation=int(body["metadata"].get("generation", 0)),
        desired_replicas=0,
        selector=labels.selector_string(owner.name),
        endpoint=previous.get("endpoint"),
        previous=previous,
        is_refresh_only=not apply,
        stale_crd=ctx.stale_crd(now_s),
    )
    version = body["metadata"].get("resourceVersion")
    try:
        spec = parse_spec(ctx.known_spec(raw_spec, now_s))
        apply_error, pruned = _apply_all(ctx, owner, spec, now_s) if apply else (None, [])
    except SpecError as e:
        obs = _observe_unparsed(ctx, owner, raw_spec, dataclasses.replace(base, spec_error=str(e)))
        return _finish(ctx, owner, obs, now_s, is_load_known=False, recorded=recorded, version=version)
    obs = dataclasses.replace(_observe(ctx, owner, spec, base), apply_error=apply_error, load=load)
    outcome = _finish(ctx, owner, obs, now_s, is_load_known=is_load_known, recorded=recorded, version=version)
    if pruned:
        log.info("%s/%s: pruned %s", owner.namespace, owner.name, ", ".join(pruned))
        gone = Event("Normal", "Pruned", f"deleted {', '.join(pruned)}: the spec no longer asks for it")
        outcome = dataclasses.replace(outcome, events=[*outcome.events, gone])
    return outcome


def _observe(ctx: Context, owner: Owner, spec: LLMDeploymentSpec, base: Observed) -> Observed:
    """What status depends on, read from the API: the Deployment, its Pods, the model's PVCs."""
    missing_pvc = next(
        (c for c in spec.claims if ctx.kube.get("PersistentVolumeClaim", owner.namespace, c) is None),
        None,
    )
    return dataclasses.replace(
        base,
        desired_replicas=spec.bounded_replicas,
        endpoint=render.endpoint_url(owner, spec),
        tensor_parallel_size=tensor_parallel_size(spec),
        can_wake=spec.autoscaling is not None and spec.autoscaling.can_wake,
        deployment=ctx.kube.get("Deployment", owner.namespace, owner.name),
        pods=ctx.kube.list("Pod", owner.namespace, labels.selector_string(owner.name)),
        missing_pvc=missing_pvc,
    )


def _observe_unparsed(ctx: Context, owner: Owner, raw_spec: Mapping[str, Any], base: Observed) -> Observed:
    """What status depends on when the spec does not parse: the children still run the last good
    spec, so status keeps reporting them (replicas, readiness, the scale subresource an HPA reads)."""
    deployment = ctx.kube.get("Deployment", owner.namespace, owner.name)
    raw_replicas = raw_spec.get("replicas")
    replicas = raw_replicas if isinstance(raw_replicas, int) else 0
    if deployment is not None:
        replicas = int((deployment.get("spec") or {}).get("replicas") or 0)
    return dataclasses.replace(
        base,
        desired_replicas=replicas,
        tensor_parallel_size=base.previous.get("tensorParallelSize"),
        can_wake=_can_wake_unparsed(raw_spec.get("autoscaling")),
        deployment=deployment,
        pods=ctx.kube.list("Pod", owner.namespace, labels.selector_string(owner.name))
        if deployment is not None
        else (),
    )


def _can_wake_unparsed(autoscaling: object) -> bool:
    """AutoscalingSpec.can_wake, read from a spec that does not parse."""
    return isinstance(autoscaling, Mapping) and autoscaling.get("mode", "builtin") != "hpa"


def _finish(
    ctx: Context,
    owner: Owner,
    obs: Observed,
    now_s: float,
    *,
    is_load_known: bool,
    recorded: Mapping[str, Any] | None,
    version: str | None = None,
) -> Outcome:
    """Compute status, write it in one patch when it changed, and derive the Events.

    The patch is made against the resourceVersion the status was computed from. When another
    writer got there first (the Deployment-event refresh and a tick race; the read was older than
    the last status patch), status is recomputed once from a fresh read: an older read must not
    overwrite newer status (observedGeneration going back), and only the writer whose patch landed
    posts the Events of a transition (no duplicates).
    """
    for attempt in range(2):
        new_status = status_mod.compute(obs, rfc3339(now_s))
        if not is_load_known:
            new_status.pop("load")  # keep what the last metrics tick saw
        new_status.update(recorded or {})
        for name in ctx.pruned_status_fields(now_s) - {"conditions"}:  # a stale CRD drops them
            new_status.pop(name, None)  # from every patch: written, they would look changed each tick
        if not _status_changed(obs.previous, new_status):
            break
        try:
            ctx.kube.patch_status(owner.namespace, owner.name, new_status, resource_version=version)
        except Conflict:
            fresh = ctx.kube.get(KIND, owner.namespace, owner.name) if attempt == 0 else None
            if fresh is None or fresh["metadata"].get("uid") != owner.uid:
                raise
            obs = dataclasses.replace(obs, previous=dict(fresh.get("status") or {}))
            version = fresh["metadata"].get("resourceVersion")
            continue
        summary = " ".join(f"{c['type']}={c['status']}({c['reason']})" for c in new_status["conditions"])
        log.info("%s/%s: status updated: %s", owner.namespace, owner.name, summary)
        break
    events = status_mod.transitions(obs.previous.get("conditions") or (), new_status["conditions"])
    events += status_mod.rollout_events(obs.previous, new_status)
    return Outcome(new_status, events, spec_error=obs.spec_error, apply_error=obs.apply_error)
