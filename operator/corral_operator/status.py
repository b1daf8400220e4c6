"""Pure status computation: observed Deployment, Pods and PVC -> LLMDeployment status and Events.

Conditions: Ready (the endpoint serves: a pod takes traffic by the rule the gateway and the
EndpointSlice controller use, or the model is at zero and a request wakes it), Available (at least
one replica is ready, so the model serves, perhaps below its desired capacity), Progressing (a
rollout or scale is under way), Degraded (something only the operator can see is wrong: bad spec,
rejected objects, missing PVC, image pulls, crash loops).

Available is deliberately not the child Deployment's Available condition: with the default
`rollout.maxUnavailable: 0` that one is False for the whole of every scale-up (fewer available
replicas than the new spec.replicas), while the old replicas keep serving. A scale-up or rollout
shows in Progressing only; a replica that cannot start shows in Degraded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from corral_engine import wire

from corral_operator.autoscaler import Load
from corral_operator.model_volumes import ADAPTER_FETCH_PREFIX

Obj = dict[str, Any]
IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
CRASH_REASONS = {"CrashLoopBackOff"}
MAX_MESSAGE = 1000
# Set by the Deployment controller; it moves only when the pod template changes (a new ReplicaSet),
# never on a scale.
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"


@dataclass(frozen=True, slots=True)
class Observed:
    """Everything status depends on, gathered by the reconciler."""

    name: str
    generation: int
    desired_replicas: int
    selector: str
    endpoint: str | None
    can_wake: bool = False  # at zero, a request brings a replica back (AutoscalingSpec.can_wake)
    deployment: Obj | None = None
    pods: Sequence[Obj] = ()
    tensor_parallel_size: int | None = None
    missing_pvc: str | None = None
    spec_error: str | None = None
    apply_error: str | None = None
    stale_crd: str | None = None  # why the installed CRD is older than the operator's (crd_drift)
    load: Load | None = None
    previous: Obj = field(default_factory=dict)
    is_refresh_only: bool = False  # nothing was applied: observedGeneration stays where it was


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def _condition(kind: str, is_true: bool, reason: str, message: str) -> Obj:
    return {
        "type": kind,
        "status": "True" if is_true else "False",
        "reason": reason,
        "message": message[:MAX_MESSAGE],
    }


def _deployment_condition(deployment: Obj | None, kind: str) -> Obj:
    for cond in (deployment or {}).get("status", {}).get("conditions") or ():
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def _is_fetcher(name: object) -> bool:
    """The model's init container, or an adapter's."""
    return name == wire.FETCH_CONTAINER or str(name).startswith(ADAPTER_FETCH_PREFIX)


def fetch_failure(pod: Obj) -> tuple[str, str] | None:
    """(reason, message) when the pod's model or adapter download failed: the reason from its exit
    code, the message from its termination message's last line (the fetcher's one-line error, which
    names the URI, no secrets)."""
    for cs in pod.get("status", {}).get("initContainerStatuses") or ():
        if not _is_fetcher(cs.get("name")):
            continue
        state = cs.get("state") or {}
        if "running" in state:
            return None  # (re)trying now
        terminated = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
        code = terminated.get("exitCode")
        if code in (None, 0):
            return None
        lines = (terminated.get("message") or "").strip().splitlines()
        detail = lines[-1] if lines else f"exit code {code}"
        name = pod.get("metadata", {}).get("name", "?")
        what = "the model" if cs.get("name") == wire.FETCH_CONTAINER else f"an adapter ({cs.get('name')})"
        return wire.FETCH_EXIT_REASONS.get(code, "FetchFailed"), f"pod {name}: cannot fetch {what}: {detail}"
    return None


def fetching(pods: Sequence[Obj]) -> str | None:
    """What the first pod downloading its model or an adapter now is fetching, if any."""
    for pod in pods:
        for cs in pod.get("status", {}).get("initContainerStatuses") or ():
            if _is_fetcher(cs.get("name")) and "running" in (cs.get("state") or {}):
                what = "the model" if cs["name"] == wire.FETCH_CONTAINER else f"an adapter ({cs['name']})"
                return f"pod {pod.get('metadata', {}).get('name', '?')}: downloading {what}"
    return None


def _restarted_after_crash(pod: Obj, cs: Obj) -> str | None:
    """Between two back-offs a crash-looping container runs (loading the model) before it fails
    again: while its last run failed and it has not been ready since this run started, it is still
    crashing, not recovered (else Degraded, and its Warning and Recovered Events, would flap with
    every restart). One that was ready in this run and is not now (busy, a failed probe) is not."""
    last = (cs.get("lastState") or {}).get("terminated") or {}
    running = (cs.get("state") or {}).get("running")
    if cs.get("ready") or running is None or last.get("exitCode") in (None, 0):
        return None
    ready: Obj = next(
        (c for c in pod.get("status", {}).get("conditions") or () if c.get("type") == "Ready"), {}
    )
    started, changed = running.get("startedAt"), ready.get("lastTransitionTime")
    if started and changed and changed > started:  # RFC 3339 UTC stamps compare as text
        return None
    why = last.get("reason") or "Error"
    return (
        f"engine restarted after exit code {last['exitCode']} ({why}), not ready yet "
        f"({cs.get('restartCount', 0)} restarts)"
    )


def _last_words(cs: Obj) -> str:
    """': REASON' from the last line of the engine's termination message (the bundled engine
    writes why it could not start there: a model it cannot load, a bad argument), or nothing."""
    state = (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated")
    terminated = state or {}
    lines = (terminated.get("message") or "").strip().splitlines()
    return f": {lines[-1]}" if lines else ""


def pod_problem(pods: Sequence[Obj]) -> tuple[str, str] | None:
    """(reason, message) for the first pod whose model download failed, that cannot pull its image,
    crash-loops or cannot schedule."""
    for pod in pods:
        name = pod.get("metadata", {}).get("name", "?")
        if failed := fetch_failure(pod):
            return failed
        for cs in pod.get("status", {}).get("containerStatuses") or ():
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason", "")
            if reason in IMAGE_PULL_REASONS:
                detail = waiting.get("message") or reason
                return "ImagePullFailed", f"pod {name}: cannot pull image {cs.get('image', '')}: {detail}"
            if reason in CRASH_REASONS:
                restarts = cs.get("restartCount", 0)
                why = f"engine keeps crashing ({restarts} restarts): {reason}"
                return "CrashLooping", f"pod {name}: {why}{_last_words(cs)}"
            if crashed := _restarted_after_crash(pod, cs):
                return "CrashLooping", f"pod {name}: {crashed}{_last_words(cs)}"
        for cond in pod.get("status", {}).get("conditions") or ():
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return (
                    "Unschedulable",
                    f"pod {name}: {cond.get('message') or cond.get('reason', 'unschedulable')}",
                )
    return None


def degraded(obs: Observed) -> Obj:
    if obs.spec_error:
        return _condition("Degraded", True, "InvalidSpec", obs.spec_error)
    if obs.missing_pvc:
        return _condition(
            "Degraded", True, "ModelVolumeMissing", f"PersistentVolumeClaim {obs.missing_pvc!r} not found"
        )
    if obs.apply_error:
        return _condition("Degraded", True, "ApplyFailed", obs.apply_error)
    problem = pod_problem(obs.pods)
    if problem:
        return _condition("Degraded", True, *problem)
    stuck = _deployment_condition(obs.deployment, "Progressing")
    if stuck.get("reason") == "ProgressDeadlineExceeded":
        return _condition("Degraded", True, "RolloutStuck", stuck.get("message", "rollout stalled"))
    failure = _deployment_condition(obs.deployment, "ReplicaFailure")
    if failure.get("status") == "True":
        return _condition("Degraded", True, "ReplicaFailure", failure.get("message", "cannot create pods"))
    if obs.stale_crd:  # last: the replicas serve; what the model's own team can fix comes first
        return _condition("Degraded", True, "StaleCRD", obs.stale_crd)
    return _condition("Degraded", False, "Healthy", "no problems observed")


def _ready_message(ready: int, want: int) -> str:
    """How many replicas are ready against how many are wanted; more than wanted while scaling down."""
    if ready > want:
        return f"{ready} replicas ready, scaling down to {want}"
    return f"{ready}/{want} replicas ready"


def available(obs: Observed, ready: int) -> Obj:
    """True while at least one replica is ready (see the module's docstring for why not more)."""
    if obs.desired_replicas == 0:
        how = "a request through the gateway wakes it" if obs.can_wake else "scale it up to serve"
        return _condition("Available", False, "ScaledToZero", f"0 replicas; {how}")
    message = _ready_message(ready, obs.desired_replicas)
    if ready >= 1:
        return _condition("Available", True, "ReplicasReady", message)
    return _condition("Available", False, "NoReplicasReady", message)


def ready_condition(obs: Observed, is_available: Obj) -> Obj:
    """`kubectl wait --for=condition=Ready`: true once a request sent now would be served (an
    invalid spec update does not stop the replicas already running from serving)."""
    if obs.spec_error and obs.deployment is None:
        return _condition("Ready", False, "InvalidSpec", obs.spec_error)
    if obs.desired_replicas == 0 and obs.can_wake:
        return _condition(
            "Ready", True, "WakesOnRequest", "0 replicas; a request through the gateway wakes it"
        )
    if is_available["status"] != "True":
        return _condition("Ready", False, is_available["reason"], is_available["message"])
    serving = sum(1 for pod in obs.pods if wire.is_pod_serving(pod))
    if serving < 1:
        return _condition("Ready", False, "NoPodServing", "no pod is Ready with an IP and not terminating")
    return _condition("Ready", True, "Serving", f"{serving} pod(s) serving at {obs.endpoint}")


def progressing(obs: Observed, ready: int) -> Obj:
    dep = obs.deployment
    if dep is None and (obs.spec_error or obs.apply_error):
        reason = "InvalidSpec" if obs.spec_error else "ApplyFailed"
        return _condition("Progressing", False, reason, "nothing to roll out until the spec is fixed")
    if dep is None:
        return _condition("Progressing", True, "Creating", "waiting for the Deployment")
    st = dep.get("status", {})
    is_current = st.get("observedGeneration", 0) >= dep.get("metadata", {}).get("generation", 0)
    updated = st.get("updatedReplicas", 0) or 0
    total = st.get("replicas", 0) or 0
    want = obs.desired_replicas
    if downloading := fetching(obs.pods):
        return _condition("Progressing", True, "FetchingModel", downloading)
    if not is_current or updated < want or ready < want or total > want:
        return _condition(
            "Progressing", True, "RollingOut", f"{updated}/{want} updated, {ready}/{want} ready, {total} pods"
        )
    return _condition("Progressing", False, "RolloutComplete", f"{want} replicas up to date")


def rolled_out_revision(deployment: Obj | None) -> int | None:
    """The Deployment's revision once every replica runs its pod template and is available (its
    controller has seen its latest spec, updated == replicas == available == spec.replicas > 0);
    None while a rollout or scale is under way, at zero replicas, or without a Deployment."""
    if deployment is None:
        return None
    meta, st = deployment.get("metadata") or {}, deployment.get("status") or {}
    revision = (meta.get("annotations") or {}).get(REVISION_ANNOTATION, "")
    want = (deployment.get("spec") or {}).get("replicas")
    is_current = st.get("observedGeneration", 0) >= meta.get("generation", 0)
    counts = (st.get("updatedReplicas"), st.get("replicas"), st.get("availableReplicas"))
    if not (revision.isdigit() and is_current and isinstance(want, int) and want > 0):
        return None
    return int(revision) if counts == (want, want, want) else None


def _keep_transition_times(new: list[Obj], previous: Sequence[Obj], now: str, generation: int) -> list[Obj]:
    old = {c.get("type"): c for c in previous}
    out = []
    for cond in new:
        before = old.get(cond["type"], {})
        is_same = before.get("status") == cond["status"]
        time = before.get("lastTransitionTime") if is_same and before.get("lastTransitionTime") else now
        out.append({**cond, "lastTransitionTime": time, "observedGeneration": generation})
    return out


def compute(obs: Observed, now: str) -> Obj:
    """The full status (None values delete stale fields in a merge patch)."""
    st = (obs.deployment or {}).get("status", {})
    ready = int(st.get("readyReplicas", 0) or 0)
    applied = obs.spec_error is None and obs.apply_error is None and not obs.is_refresh_only
    is_available = available(obs, ready)
    conditions = [ready_condition(obs, is_available), is_available, progressing(obs, ready), degraded(obs)]
    prev_generation = obs.previous.get("observedGeneration")
    generation = obs.generation if applied else prev_generation
    if isinstance(prev_generation, int) and (generation is None or generation < prev_generation):
        generation = prev_generation  # never backwards (kstatus, Argo CD, `kubectl wait` read it)
    load = obs.load
    revision = rolled_out_revision(obs.deployment)
    return {
        "observedGeneration": generation,
        "replicas": int(st.get("replicas", 0) or 0),
        "readyReplicas": ready,
        "updatedReplicas": int(st.get("updatedReplicas", 0) or 0),
        "selector": obs.selector,
        "endpoint": obs.endpoint,
        "tensorParallelSize": obs.tensor_parallel_size,
        "rolledOutRevision": revision or obs.previous.get("rolledOutRevision"),
        "rolledOutGeneration": generation if revision else obs.previous.get("rolledOutGeneration"),
        "conditions": _keep_transition_times(
            conditions, obs.previous.get("conditions") or (), now, obs.generation
        ),
        "load": None
        if load is None
        else {
            "kvUsagePercent": round(load.kv_usage_ratio * 100),
            "numRequestsWaiting": round(load.num_waiting),
            "numRequestsRunning": round(load.num_running),
            "observedAt": now,
        },
    }


def transitions(previous: Sequence[Obj], current: Sequence[Obj]) -> list[Event]:
    """Events for condition changes worth a human's attention."""
    old = {c.get("type"): (c.get("status"), c.get("reason")) for c in previous}
    events: list[Event] = []
    for cond in current:
        kind, status, reason = cond["type"], cond["status"], cond["reason"]
        if old.get(kind) == (status, reason):
            continue
        if kind == "Degraded" and status == "True":
            events.append(Event("Warning", reason, cond["message"]))
        elif kind == "Degraded" and kind in old and old[kind][0] == "True":
            events.append(Event("Normal", "Recovered", f"no longer degraded ({old[kind][1]})"))
        elif kind == "Ready":
            continue  # follows Available; one Event per transition is enough
        elif kind == "Available" and status == "True" and old.get(kind, (None,))[0] != "True":
            events.append(Event("Normal", "Available", cond["message"]))
        elif kind == "Available" and status == "False" and old.get(kind, (None,))[0] == "True":
            events.append(Event("Warning" if reason != "ScaledToZero" else "Normal", reason, cond["message"]))
    return events


def rollout_events(previous: Obj, current: Obj) -> list[Event]:
    """`RolledOut` once the pods of a new template all run and are ready: once per Deployment
    revision, so a scale (same template) posts nothing. The first revision status records (a new
    LLMDeployment, or one from before this field) posts nothing either: no update rolled out.
    The message names the generation only when it moved since the last rollout: a `kubectl rollout
    restart` makes a new revision of the same spec."""
    before, now = previous.get("rolledOutRevision"), current.get("rolledOutRevision")
    if before is None or now is None or now == before:
        return []
    n = current.get("updatedReplicas", 0)
    generation = current.get("rolledOutGeneration")
    what = f"Deployment revision {now}"
    if generation is not None and generation != previous.get("rolledOutGeneration"):
        what = f"generation {generation}, {what}"
    return [Event("Normal", "RolledOut", f"{what}: {n}/{n} replicas run the new pods and are ready")]
