"""Pure status computation from observed Deployments and Pods, and the Events on transitions."""

from __future__ import annotations

import itertools
from typing import Any

from corral_operator.autoscaler import Load
from corral_operator.status import Event, Observed, compute, rollout_events, transitions

NOW = "2026-01-01T00:00:00Z"


def deployment(
    replicas: int, ready: int, updated: int | None = None, generation: int = 1, **conds: str
) -> dict:
    conditions = [{"type": "Available", "status": "True" if ready else "False"}]
    conditions += [{"type": k, "status": "False", "reason": v, "message": v} for k, v in conds.items()]
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "conditions": conditions,
        },
    }


def pod(waiting_reason: str | None = None, **extra: Any) -> dict:
    statuses = []
    if waiting_reason:
        statuses = [{"image": "img:1", "restartCount": 5, "state": {"waiting": {"reason": waiting_reason}}}]
    return {"metadata": {"name": "p-1"}, "status": {"containerStatuses": statuses, **extra}}


def observed(**changes: Any) -> Observed:
    base: dict[str, Any] = {
        "name": "tiny",
        "generation": 3,
        "desired_replicas": 2,
        "selector": "a=b",
        "endpoint": "http://tiny.ml.svc:8000",
    }
    return Observed(**{**base, **changes})


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_ready_fleet_is_available_and_settled() -> None:
    st = compute(observed(deployment=deployment(2, 2)), NOW)
    assert st["observedGeneration"] == 3 and st["readyReplicas"] == 2 and st["replicas"] == 2
    assert cond(st, "Available")["status"] == "True"
    assert cond(st, "Progressing")["status"] == "False"
    assert cond(st, "Degraded")["status"] == "False"
    assert st["selector"] == "a=b" and st["endpoint"] == "http://tiny.ml.svc:8000"
    assert st["load"] is None


def test_rollout_in_progress() -> None:
    st = compute(observed(deployment=deployment(3, 1, updated=1)), NOW)
    assert cond(st, "Progressing") | {"lastTransitionTime": None} == {
        "type": "Progressing",
        "status": "True",
        "reason": "RollingOut",
        "message": "1/2 updated, 1/2 ready, 3 pods",
        "lastTransitionTime": None,
        "observedGeneration": 3,
    }
    assert cond(st, "Available")["status"] == "True"


def test_operator_only_problems_are_degraded_with_reasons() -> None:
    cases = {
        "ModelVolumeMissing": observed(missing_pvc="models"),
        "ImagePullFailed": observed(pods=[pod("ImagePullBackOff")]),
        "CrashLooping": observed(pods=[pod("CrashLoopBackOff")]),
        "Unschedulable": observed(
            pods=[pod(conditions=[{"type": "PodScheduled", "status": "False", "message": "0/3 nodes: gpu"}])]
        ),
        "InvalidSpec": observed(spec_error="spec.engine.args: bad"),
        "RolloutStuck": observed(deployment=deployment(2, 0, Progressing="ProgressDeadlineExceeded")),
    }
    for reason, obs in cases.items():
        degraded = cond(compute(obs, NOW), "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", reason)
        assert degraded["message"]
    assert "models" in cond(compute(cases["ModelVolumeMissing"], NOW), "Degraded")["message"]


def test_invalid_spec_keeps_the_previous_observed_generation() -> None:
    st = compute(observed(spec_error="bad", previous={"observedGeneration": 2}), NOW)
    assert st["observedGeneration"] == 2


def test_scaled_to_zero_is_not_available_with_a_reason() -> None:
    st = compute(observed(desired_replicas=0, can_wake=True, deployment=deployment(0, 0)), NOW)
    available = cond(st, "Available")
    assert (available["status"], available["reason"]) == ("False", "ScaledToZero")
    assert "wakes" in available["message"]


def test_load_is_reported_in_percent() -> None:
    load = Load(num_waiting=7.0, num_running=3.0, kv_usage_ratio=0.425, num_reporting=2)
    st = compute(observed(deployment=deployment(2, 2), load=load), NOW)
    assert st["load"] == {
        "kvUsagePercent": 42,
        "numRequestsWaiting": 7,
        "numRequestsRunning": 3,
        "observedAt": NOW,
    }


def test_transition_times_only_move_on_change() -> None:
    first = compute(observed(deployment=deployment(2, 2)), "2026-01-01T00:00:00Z")
    again = compute(observed(deployment=deployment(2, 2), previous=first), "2026-01-01T01:00:00Z")
    assert cond(again, "Available")["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    broken = compute(observed(deployment=deployment(2, 0), previous=first), "2026-01-01T02:00:00Z")
    assert cond(broken, "Available")["lastTransitionTime"] == "2026-01-01T02:00:00Z"


def test_events_on_important_transitions_only() -> None:
    healthy = compute(observed(deployment=deployment(2, 2)), NOW)["conditions"]
    crashing = compute(observed(deployment=deployment(2, 0), pods=[pod("CrashLoopBackOff")]), NOW)[
        "conditions"
    ]
    assert [(e.type, e.reason) for e in transitions([], healthy)] == [("Normal", "Available")]
    assert transitions(healthy, healthy) == []
    events = [(e.type, e.reason) for e in transitions(healthy, crashing)]
    assert ("Warning", "CrashLooping") in events and ("Warning", "NoReplicasReady") in events
    assert ("Normal", "Recovered") in [(e.type, e.reason) for e in transitions(crashing, healthy)]


def serving_pod(ip: str = "127.0.0.2", **meta: Any) -> dict:
    ready = {"type": "Ready", "status": "True"}
    return {"metadata": {"name": "p", **meta}, "status": {"podIP": ip, "conditions": [ready]}}


def ready_of(status: dict) -> tuple[str, str]:
    return cond(status, "Ready")["status"], cond(status, "Ready")["reason"]


def test_ready_needs_available_replicas_and_a_pod_taking_traffic() -> None:
    pods = [serving_pod(), serving_pod("127.0.0.3", deletionTimestamp="2026-01-01T00:00:00Z")]
    serving = compute(observed(deployment=deployment(2, 2), pods=pods), NOW)
    assert ready_of(serving) == ("True", "Serving")
    assert cond(serving, "Ready")["message"] == "1 pod(s) serving at http://tiny.ml.svc:8000"
    no_ip = compute(observed(deployment=deployment(2, 2), pods=[serving_pod(ip="")]), NOW)
    assert ready_of(no_ip) == ("False", "NoPodServing")
    starting = compute(observed(deployment=deployment(2, 0), pods=[serving_pod()]), NOW)
    assert ready_of(starting) == ("False", "NoReplicasReady")
    bad = compute(observed(spec_error="spec.model: bad", pods=[serving_pod()]), NOW)
    assert ready_of(bad) == ("False", "InvalidSpec")


def test_ready_at_zero_only_when_a_request_wakes_it() -> None:
    woken = compute(observed(desired_replicas=0, can_wake=True, deployment=deployment(0, 0)), NOW)
    assert ready_of(woken) == ("True", "WakesOnRequest")
    parked = compute(observed(desired_replicas=0, deployment=deployment(0, 0)), NOW)
    assert ready_of(parked) == ("False", "ScaledToZero")


def fetch_pod(state: dict, last: dict | None = None) -> dict:
    status = {"name": "fetch-model", "state": state, "lastState": last or {}}
    return {"metadata": {"name": "p-1"}, "status": {"initContainerStatuses": [status]}}


def test_a_failed_download_is_degraded_with_the_fetchers_reason_and_last_line() -> None:
    message = "downloading...\nModelUnauthorized: hf://org/m: 401 (no token or a refused one)\n"
    failed = fetch_pod(
        {"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"exitCode": 4, "message": message}}
    )
    st = compute(observed(deployment=deployment(1, 0), pods=[failed]), NOW)
    degraded = cond(st, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelUnauthorized")
    assert (
        degraded["message"]
        == "pod p-1: cannot fetch the model: ModelUnauthorized: hf://org/m: 401 (no token or a refused one)"
    )
    disk = fetch_pod({"terminated": {"exitCode": 5}})
    assert cond(compute(observed(pods=[disk]), NOW), "Degraded")["reason"] == "DiskFull"


def test_a_download_in_progress_is_progressing_and_a_finished_one_is_no_problem() -> None:
    running = fetch_pod({"running": {}}, {"terminated": {"exitCode": 1}})
    st = compute(observed(deployment=deployment(1, 0), pods=[running]), NOW)
    assert (cond(st, "Progressing")["reason"], cond(st, "Degraded")["status"]) == ("FetchingModel", "False")
    done = fetch_pod({"terminated": {"exitCode": 0}})
    assert (
        cond(compute(observed(deployment=deployment(1, 1), pods=[done]), NOW), "Degraded")["status"]
        == "False"
    )


def scaling_up(replicas: int, ready: int) -> dict:
    """A Deployment mid scale-up with maxUnavailable 0: its own Available condition is False."""
    dep = deployment(replicas, ready)
    dep["status"]["conditions"] = [
        {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"},
        {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
    ]
    return dep


def test_a_scale_up_keeps_ready_and_available_and_shows_only_in_progressing() -> None:
    before = compute(observed(desired_replicas=4, deployment=deployment(4, 4), pods=[serving_pod()]), NOW)
    during = compute(
        observed(desired_replicas=6, deployment=scaling_up(6, 4), pods=[serving_pod()], previous=before), NOW
    )
    assert ready_of(during) == ("True", "Serving")
    available = cond(during, "Available")
    assert (available["status"], available["reason"], available["message"]) == (
        "True",
        "ReplicasReady",
        "4/6 replicas ready",
    )
    assert (cond(during, "Progressing")["status"], cond(during, "Progressing")["reason"]) == (
        "True",
        "RollingOut",
    )
    assert transitions(before["conditions"], during["conditions"]) == []  # no Warning for a scale-up


def test_ready_replicas_above_the_desired_count_read_as_a_scale_down() -> None:
    st = compute(observed(desired_replicas=3, deployment=deployment(10, 10)), NOW)
    assert cond(st, "Available")["message"] == "10 replicas ready, scaling down to 3"


def test_observed_generation_never_goes_back() -> None:
    newer = {"observedGeneration": 4}
    refresh = compute(observed(generation=4, is_refresh_only=True, previous=newer), NOW)
    assert refresh["observedGeneration"] == 4
    stale = compute(observed(generation=3, deployment=deployment(2, 2), previous=newer), NOW)
    assert stale["observedGeneration"] == 4


def test_an_invalid_spec_update_keeps_reporting_the_running_replicas() -> None:
    st = compute(
        observed(spec_error="spec.rollout.maxSurge: bad", deployment=deployment(2, 2), pods=[serving_pod()]),
        NOW,
    )
    assert (st["replicas"], st["readyReplicas"]) == (2, 2)
    assert ready_of(st) == ("True", "Serving")
    assert cond(st, "Available")["status"] == "True"
    assert cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert (cond(st, "Degraded")["status"], cond(st, "Degraded")["reason"]) == ("True", "InvalidSpec")


def test_nothing_progresses_while_the_spec_cannot_be_applied() -> None:
    for obs, reason in (
        (observed(spec_error="bad"), "InvalidSpec"),
        (observed(apply_error="no"), "ApplyFailed"),
    ):
        progressing = cond(compute(obs, NOW), "Progressing")
        assert (progressing["status"], progressing["reason"]) == ("False", reason)


def test_a_crash_looping_engine_between_back_offs_stays_degraded_without_recovered_events() -> None:
    # CrashLoopBackOff, then running (loading the model, not ready) until it fails again
    backing_off = pod("CrashLoopBackOff")
    last_run = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    loading = {"image": "img:1", "restartCount": 6, "ready": False, "state": {"running": {}}}
    restarted = pod(containerStatuses=[loading | {"lastState": last_run}])
    statuses = [
        compute(observed(deployment=deployment(2, 0), pods=[p]), NOW)
        for p in (backing_off, restarted, backing_off, restarted)
    ]
    assert [(cond(st, "Degraded")["status"], cond(st, "Degraded")["reason"]) for st in statuses] == [
        ("True", "CrashLooping")
    ] * 4
    assert "exit code 137 (OOMKilled), not ready yet (6 restarts)" in cond(statuses[1], "Degraded")["message"]
    steps = itertools.pairwise(st["conditions"] for st in statuses)
    assert [e for before, after in steps for e in transitions(before, after)] == []
    # ready again, or restarted after a clean exit: no problem
    serving = pod(containerStatuses=[loading | {"ready": True, "lastState": last_run}])
    clean = pod(containerStatuses=[loading | {"lastState": {"terminated": {"exitCode": 0}}}])
    # ready in this run after the crash, then not (busy, a failed probe): not crashing
    busy = pod(
        containerStatuses=[
            loading | {"lastState": last_run, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
        ]
    )
    busy["status"]["conditions"] = [
        {"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T01:00:00Z"}
    ]
    for fine in (serving, clean, busy):
        st = compute(observed(deployment=deployment(2, 2), pods=[fine]), NOW)
        assert cond(st, "Degraded")["status"] == "False"


def rolled(revision: int, replicas: int, updated: int, available: int, observed: int = 5) -> dict:
    """A Deployment at `revision` (its controller's annotation) at generation 5."""
    return {
        "metadata": {"generation": 5, "annotations": {"deployment.kubernetes.io/revision": str(revision)}},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": updated,
            "readyReplicas": available,
            "availableReplicas": available,
        },
    }


def test_rolled_out_once_when_every_replica_runs_the_new_template_and_is_ready() -> None:
    before = {"rolledOutRevision": 1, "rolledOutGeneration": 2}
    for partway in (rolled(2, 3, 1, 3), rolled(2, 3, 3, 2), rolled(2, 3, 3, 3, observed=4)):
        st = compute(observed(deployment=partway, previous=before), NOW)
        assert st["rolledOutRevision"] == 1 and st["rolledOutGeneration"] == 2
        assert rollout_events(before, st) == []
    done = compute(observed(deployment=rolled(2, 3, 3, 3), previous=before), NOW)
    assert done["rolledOutRevision"] == 2 and done["rolledOutGeneration"] == 3
    assert rollout_events(before, done) == [
        Event(
            "Normal",
            "RolledOut",
            "generation 3, Deployment revision 2: 3/3 replicas run the new pods and are ready",
        )
    ]
    assert rollout_events(done, done) == []  # the next tick: said once


def test_a_restart_of_the_same_spec_rolls_out_a_revision_not_a_generation() -> None:
    settled = compute(observed(deployment=rolled(2, 3, 3, 3), previous={"rolledOutRevision": 1}), NOW)
    restarted = compute(observed(deployment=rolled(3, 3, 3, 3), previous=settled), NOW)
    assert rollout_events(settled, restarted) == [  # `kubectl rollout restart`: generation 3 still
        Event("Normal", "RolledOut", "Deployment revision 3: 3/3 replicas run the new pods and are ready")
    ]


def test_a_scale_or_the_first_revision_seen_is_not_a_rollout() -> None:
    settled = {"rolledOutRevision": 2}
    scaled = compute(observed(deployment=rolled(2, 5, 5, 5), previous=settled), NOW)
    assert scaled["rolledOutRevision"] == 2 and rollout_events(settled, scaled) == []
    created = compute(observed(deployment=rolled(1, 1, 1, 1)), NOW)
    assert created["rolledOutRevision"] == 1 and rollout_events({}, created) == []
    asleep = compute(observed(deployment=rolled(3, 0, 0, 0), previous=settled), NOW)
    assert asleep["rolledOutRevision"] == 2  # the new template rolls out when it wakes


def test_a_crashing_engine_says_why_in_the_status() -> None:
    """The bundled engine writes why it could not start to its termination message; Degraded's
    message ends with that line, in back-off and while restarting alike."""
    words = "Traceback...\ncannot load the model: quantization method 'awq' is not supported"
    last_run = {"terminated": {"exitCode": 1, "reason": "Error", "message": words}}
    backing_off = pod("CrashLoopBackOff")
    backing_off["status"]["containerStatuses"][0]["lastState"] = last_run
    loading = {"image": "img:1", "restartCount": 6, "ready": False, "state": {"running": {}}}
    restarted = pod(containerStatuses=[loading | {"lastState": last_run}])
    for p in (backing_off, restarted):
        message = cond(compute(observed(deployment=deployment(2, 0), pods=[p]), NOW), "Degraded")["message"]
        assert message.endswith(": cannot load the model: quantization method 'awq' is not supported")
    quiet = observed(deployment=deployment(2, 0), pods=[pod("CrashLoopBackOff")])
    silent = cond(compute(quiet, NOW), "Degraded")
    assert silent["message"] == "pod p-1: engine keeps crashing (5 restarts): CrashLoopBackOff"
