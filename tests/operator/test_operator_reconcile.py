"""reconcile() and autoscale() against an in-memory API (the real one is exercised in e2e/operator)."""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import pytest
from corral_operator import labels
from corral_operator.autoscaler import Load, State
from corral_operator.context import SPEC_RECHECK_S, Context
from corral_operator.crd import expected_schema
from corral_operator.kube import Conflict, Forbidden, Invalid
from corral_operator.metrics import PodTarget
from corral_operator.reconcile import reconcile
from corral_operator.scaling import autoscale

from tests.operator.invalid_cases import valid_spec


class FakeKube:
    """Stores applied objects by (kind, namespace, name); records every write."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, Any]] = []
        self.reject_kind: str | None = None
        self.reject_error: Exception | None = None  # default: Invalid (422)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == self.reject_kind:
            raise self.reject_error or Invalid(422, f"{obj['kind']} is invalid")
        meta = obj["metadata"]
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = f"uid-{obj['kind']}"
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = stored
        self.writes.append(("apply", obj["kind"]))
        return stored

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        wanted = dict(part.split("=") for part in label_selector.split(","))
        return [
            o
            for (k, ns, _), o in self.objects.items()
            if k == kind and ns == namespace and wanted.items() <= o["metadata"].get("labels", {}).items()
        ]

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> bool:
        self.writes.append(("delete", kind))
        return self.objects.pop((kind, namespace, name), None) is not None

    def patch_status(
        self, namespace: str, name: str, status: dict[str, Any], resource_version: str | None = None
    ) -> None:
        """A stored LLMDeployment (see `store_cr`) gets the merge patch, with the API server's
        optimistic concurrency: a stale resource_version is a Conflict."""
        cr = self.objects.get(("LLMDeployment", namespace, name))
        if cr is not None:
            if resource_version is not None and resource_version != cr["metadata"]["resourceVersion"]:
                raise Conflict(409, "the object has been modified; please apply your changes again")
            merged = {**cr.get("status", {}), **status}
            known = (self.schema or {}).get("properties", {}).get("status", {}).get("properties")
            # the API server prunes what the served schema lacks
            cr["status"] = {
                k: v for k, v in merged.items() if v is not None and (known is None or k in known)
            }
            cr["metadata"]["resourceVersion"] = str(int(cr["metadata"]["resourceVersion"]) + 1)
        self.writes.append(("status", dict(status)))

    def store_cr(self, cr: dict[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(cr)
        stored["metadata"].setdefault("resourceVersion", "1")
        self.objects[("LLMDeployment", cr["metadata"]["namespace"], cr["metadata"]["name"])] = stored
        return stored

    def patch_replicas(self, namespace: str, name: str, replicas: int) -> None:
        self.writes.append(("replicas", replicas))

    served: frozenset[str] = frozenset()  # optional kinds the API server serves
    refused: frozenset[str] = frozenset()  # optional kinds whose API discovery is 403

    def serves(self, kind: str) -> bool:
        if kind in self.refused:
            raise Forbidden(403, "forbidden")
        return kind in self.served

    schema: dict[str, Any] | None = None  # the served LLMDeployment schema; None: not published

    def served_schema(self, kind: str) -> dict[str, Any] | None:
        return self.schema


def body(spec: dict[str, Any], status: dict[str, Any] | None = None, generation: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny", "namespace": "ml", "uid": "cr-uid", "generation": generation},
        "spec": spec,
        "status": status or {},
    }


def make_ctx(kube: FakeKube, metrics: Any = None) -> Context:
    return Context(kube=kube, metrics=metrics)  # type: ignore[arg-type]


def test_reconcile_applies_children_and_is_idempotent() -> None:
    kube = FakeKube()
    outcome = reconcile(make_ctx(kube), body(valid_spec()), now_s=0)
    assert {k for k, _, _ in kube.objects} == {"Deployment", "Service", "PodDisruptionBudget"}
    assert outcome.status["observedGeneration"] == 1
    assert [w[0] for w in kube.writes].count("status") == 1
    kube.writes.clear()
    again = reconcile(make_ctx(kube), body(valid_spec(), status=outcome.status), now_s=10)
    assert [w[0] for w in kube.writes] == ["apply", "apply", "apply"]  # no status write, no delete
    assert again.events == []


def test_reconcile_prunes_what_the_spec_no_longer_asks_for() -> None:
    kube = FakeKube()
    with_hpa = valid_spec() | {"autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3}}
    reconcile(make_ctx(kube), body(with_hpa), now_s=0)
    assert ("HorizontalPodAutoscaler", "ml", "tiny") in kube.objects
    # owner references carry the CR's uid; only objects owned by this CR are pruned
    outcome = reconcile(make_ctx(kube), body(valid_spec(), generation=2), now_s=1)
    assert ("HorizontalPodAutoscaler", "ml", "tiny") not in kube.objects
    assert ("delete", "HorizontalPodAutoscaler") in kube.writes
    assert [e.reason for e in outcome.events if e.reason == "Pruned"] == ["Pruned"]


def test_the_disruption_budget_stays_while_replicas_move_between_one_and_two() -> None:
    kube = FakeKube()
    for generation, replicas in enumerate((2, 1, 2, 1), start=1):
        spec = valid_spec() | {"replicas": replicas}
        outcome = reconcile(make_ctx(kube), body(spec, generation=generation), now_s=generation)
        assert ("PodDisruptionBudget", "ml", "tiny") in kube.objects
        assert [e.reason for e in outcome.events if e.reason == "Pruned"] == []
    assert ("delete", "PodDisruptionBudget") not in kube.writes


def test_invalid_spec_becomes_degraded_status_not_a_crash() -> None:
    kube = FakeKube()
    bad = valid_spec()
    bad["engine"]["args"] = {"blockSize": 3}
    outcome = reconcile(make_ctx(kube), body(bad), now_s=0)
    assert outcome.spec_error and "power of two" in outcome.spec_error
    assert kube.objects == {}
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert ("Warning", "InvalidSpec") in [(e.type, e.reason) for e in outcome.events]


def test_rejected_apply_is_reported() -> None:
    kube = FakeKube()
    kube.reject_kind = "Service"
    outcome = reconcile(make_ctx(kube), body(valid_spec()), now_s=0)
    assert outcome.apply_error and "Service" in outcome.apply_error
    assert outcome.status["observedGeneration"] is None


def test_missing_pvc_is_degraded() -> None:
    spec = valid_spec()
    spec["model"]["source"] = {"pvc": {"claimName": "models"}}
    outcome = reconcile(make_ctx(FakeKube()), body(spec), now_s=0)
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ModelVolumeMissing"


class DeepQueue:
    def __init__(self) -> None:
        self.seen: list[PodTarget] = []

    def load(self, namespace: str, name: str, targets: list[PodTarget]) -> Load | None:
        self.seen = list(targets)
        return Load(num_waiting=40, num_running=8, kv_usage_ratio=0.9, num_reporting=len(targets))


def ready_pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "labels": labels.selector("tiny")},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_autoscale_scrapes_ready_pods_and_writes_replicas() -> None:
    kube = FakeKube()
    kube.objects[("Pod", "ml", "p1")] = ready_pod("p1", "127.0.0.11")
    source = DeepQueue()
    spec = valid_spec() | {
        "autoscaling": {"minReplicas": 1, "maxReplicas": 5, "scaleUpStabilizationSeconds": 0}
    }
    outcome = autoscale(make_ctx(kube, source), body(spec), State(), now_s=100, scrape=True)
    assert source.seen == [PodTarget("p1", "127.0.0.11", 8000)]
    assert outcome.decision is not None and outcome.decision.replicas == 5
    assert ("replicas", 5) in kube.writes
    assert outcome.event is not None and outcome.event.reason == "Scaled"


def test_wake_annotation_brings_a_model_back_from_zero() -> None:
    kube = FakeKube()
    spec = valid_spec() | {"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    cr = body(spec)
    asleep = State(zeroed_at_s=1000, last_replicas=0)
    assert autoscale(make_ctx(kube), cr, asleep, now_s=2000, scrape=False).decision.replicas == 0  # type: ignore[union-attr]
    cr["metadata"]["annotations"] = {labels.WAKE_ANNOTATION: "1970-01-01T00:25:00Z"}  # t = 1500
    outcome = autoscale(make_ctx(kube), cr, asleep, now_s=2000, scrape=False)
    assert outcome.decision is not None and outcome.decision.replicas == 1
    assert ("replicas", 1) in kube.writes


def test_a_model_at_zero_shows_no_load_rather_than_the_last_one_seen() -> None:
    kube = FakeKube()
    spec = valid_spec() | {"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    seen = {"kvUsagePercent": 80, "numRequestsWaiting": 4, "numRequestsRunning": 4, "observedAt": "x"}
    cr = body(spec, status={"load": seen})
    scaled = autoscale(make_ctx(kube, DeepQueue()), cr, State(), now_s=100, scrape=True)
    assert (scaled.load, scaled.is_load_known) == (None, True)
    outcome = reconcile(make_ctx(kube), cr, load=scaled.load, is_load_known=scaled.is_load_known, now_s=100)
    assert outcome.status["load"] is None  # the merge patch deletes it: KV% and Waiting go blank


def test_at_zero_only_an_autoscaler_that_scales_from_zero_makes_it_ready() -> None:
    kube = FakeKube()

    def ready_at_zero(autoscaling: dict[str, Any]) -> tuple[str, str]:
        spec = valid_spec() | {"replicas": 0, "autoscaling": autoscaling}
        outcome = reconcile(make_ctx(kube), body(spec), now_s=0)
        ready = next(c for c in outcome.status["conditions"] if c["type"] == "Ready")
        return ready["status"], ready["reason"]

    assert ready_at_zero({"minReplicas": 0}) == ("True", "WakesOnRequest")
    # `kubectl scale --replicas 0` under an HPA: the HPA stops acting, and no request wakes it
    assert ready_at_zero({"mode": "hpa", "minReplicas": 1}) == ("False", "ScaledToZero")
    # the same after an update that does not parse (status keeps reporting what runs)
    assert ready_at_zero({"mode": "hpa", "minReplicas": 1, "maxReplicas": "x"}) == ("False", "ScaledToZero")


def test_parse_time_accepts_rfc3339_and_epoch() -> None:
    from corral_operator.timestamps import parse_time

    assert parse_time("1970-01-01T00:25:00Z") == 1500.0
    assert parse_time("1970-01-01T00:25:00.5Z") == 1500.5
    assert parse_time("1970-01-01T01:25:00+01:00") == 1500.0
    assert parse_time("1500") == 1500.0
    assert parse_time("soon") is None and parse_time(None) is None


def test_no_status_write_when_only_absent_fields_differ() -> None:
    kube = FakeKube()
    first = reconcile(make_ctx(kube), body(valid_spec()), load=None, is_load_known=True, now_s=0)
    assert first.status["load"] is None
    stored = {k: v for k, v in first.status.items() if v is not None}  # what a merge patch leaves
    kube.writes.clear()
    reconcile(make_ctx(kube), body(valid_spec(), status=stored), load=None, is_load_known=True, now_s=5)
    assert [w for w in kube.writes if w[0] == "status"] == []


def autoscaled_spec() -> dict[str, Any]:
    return valid_spec() | {
        "autoscaling": {"minReplicas": 1, "maxReplicas": 5, "scaleUpStabilizationSeconds": 0}
    }


def test_a_tick_that_scales_patches_status_once() -> None:
    kube = FakeKube()
    kube.objects[("Pod", "ml", "p1")] = ready_pod("p1", "127.0.0.11")
    ctx = make_ctx(kube, DeepQueue())
    scaled = autoscale(ctx, body(autoscaled_spec()), State(), now_s=100, scrape=True)
    assert [w for w in kube.writes if w[0] == "status"] == []  # the autoscaler records, never writes
    assert scaled.status == {
        "lastScaleTime": "1970-01-01T00:01:40Z",
        "lastActiveTime": "1970-01-01T00:01:40Z",
    }
    reconcile(
        ctx, body(autoscaled_spec()), load=scaled.load, is_load_known=True, recorded=scaled.status, now_s=100
    )
    status_writes = [w[1] for w in kube.writes if w[0] == "status"]
    assert len(status_writes) == 1
    assert status_writes[0]["lastScaleTime"] == "1970-01-01T00:01:40Z"
    assert status_writes[0]["load"]["numRequestsWaiting"] == 40 and status_writes[0]["conditions"]


def test_what_the_autoscaler_recorded_survives_a_failed_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    import kopf
    from corral_operator import handlers
    from corral_operator.kube import Unavailable

    monkeypatch.setattr(kopf, "event", lambda *args, **kwargs: None)  # no kopf event queue here
    kube = FakeKube()
    kube.objects[("Pod", "ml", "p1")] = ready_pod("p1", "127.0.0.11")
    memo = kopf.Memo(ctx=make_ctx(kube, DeepQueue()))
    logger = logging.getLogger("test")
    cr = kopf.Body(body(autoscaled_spec()))  # type: ignore[arg-type]
    kube.reject_kind, kube.reject_error = "Deployment", Unavailable(503, "API server restarting")
    with pytest.raises(kopf.TemporaryError):
        handlers.on_timer(body=cr, memo=memo, logger=logger)
    assert ("replicas", 5) in kube.writes and not [w for w in kube.writes if w[0] == "status"]
    kube.reject_kind = None
    patched = kopf.Body(body(autoscaled_spec() | {"replicas": 5}, generation=2))  # type: ignore[arg-type]
    handlers.on_timer(body=patched, memo=memo, logger=logger)
    status_writes = [w[1] for w in kube.writes if w[0] == "status"]
    assert len(status_writes) == 1 and "lastScaleTime" in status_writes[0]
    assert memo["recorded"] == {}


def test_a_tick_on_a_body_older_than_one_already_handled_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A timer read the body at generation 1 (replicas 0) and waited for the object's lock while the
    # wake was handled and replicas patched to 1: acting on it would reapply replicas 0 (and take a
    # wake stamp of the same second for a new one).
    import kopf
    from corral_operator import handlers

    monkeypatch.setattr(kopf, "event", lambda *args, **kwargs: None)
    kube = FakeKube()
    memo = kopf.Memo(ctx=make_ctx(kube))
    memo["autoscaler"] = State(zeroed_at_s=1000, last_replicas=0)
    logger = logging.getLogger("test")
    spec = valid_spec() | {"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    asleep = body(spec, generation=1)
    woken = copy.deepcopy(asleep)
    woken["metadata"]["annotations"] = {labels.WAKE_ANNOTATION: "1970-01-01T00:25:00Z"}
    handlers.on_change(body=kopf.Body(woken), memo=memo, logger=logger)  # type: ignore[arg-type]
    assert kube.writes.count(("replicas", 1)) == 1
    kube.writes.clear()
    handlers.on_timer(body=kopf.Body(asleep), memo=memo, logger=logger)  # type: ignore[arg-type]
    handlers.on_timer(body=kopf.Body(woken), memo=memo, logger=logger)  # type: ignore[arg-type]
    assert kube.writes == []
    up = body(spec | {"replicas": 1}, generation=2)
    handlers.on_timer(body=kopf.Body(up), memo=memo, logger=logger)  # type: ignore[arg-type]
    assert ("apply", "Deployment") in kube.writes and memo["autoscaler"].last_replicas == 1


def test_hpa_mode_renders_an_hpa_and_never_writes_replicas() -> None:
    kube = FakeKube()
    kube.objects[("Pod", "ml", "p1")] = ready_pod("p1", "127.0.0.11")
    spec = valid_spec() | {"autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 5}}
    outcome = autoscale(make_ctx(kube, DeepQueue()), body(spec), State(), now_s=100, scrape=True)
    assert outcome.decision is None and not [w for w in kube.writes if w[0] == "replicas"]
    reconcile(make_ctx(kube), body(spec), now_s=100)
    assert ("HorizontalPodAutoscaler", "ml", "tiny") in kube.objects
    # back to a fixed size: the HPA is pruned
    reconcile(make_ctx(kube), body(valid_spec(), generation=2), now_s=200)
    assert ("HorizontalPodAutoscaler", "ml", "tiny") not in kube.objects


def test_keda_mode_without_keda_installed_is_reported_and_with_it_renders_a_scaled_object() -> None:
    kube = FakeKube()
    auto = {"mode": "keda", "minReplicas": 0, "maxReplicas": 3, "prometheusUrl": "http://prom:9090"}
    spec = valid_spec() | {"autoscaling": auto}
    outcome = reconcile(make_ctx(kube), body(spec), now_s=0)
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert "scaledobjects.keda.sh is not installed" in degraded["message"]
    kube.served = frozenset({"ScaledObject"})
    outcome = reconcile(make_ctx(kube), body(spec), now_s=100)
    assert ("ScaledObject", "ml", "tiny") in kube.objects
    assert next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")["status"] == "False"


def test_keda_mode_when_api_discovery_is_refused_says_it_is_a_permission_problem() -> None:
    kube = FakeKube()
    kube.refused = frozenset({"ScaledObject", "ServiceMonitor"})
    auto = {"mode": "keda", "minReplicas": 0, "maxReplicas": 3, "prometheusUrl": "http://prom:9090"}
    outcome = reconcile(make_ctx(kube), body(valid_spec() | {"autoscaling": auto}), now_s=0)
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert "403 Forbidden" in degraded["message"] and "permission problem" in degraded["message"]
    assert "not installed" not in degraded["message"]
    assert {k for k, _, _ in kube.objects} == {"Deployment", "Service", "PodDisruptionBudget"}


def running(kube: FakeKube, ready: int) -> None:
    """The stored Deployment as the controller reports it, with `ready` serving pods."""
    dep = kube.objects[("Deployment", "ml", "tiny")]
    replicas = dep["spec"]["replicas"]
    dep["metadata"]["generation"] = 1
    dep["status"] = {
        "observedGeneration": 1,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": replicas,
        "conditions": [{"type": "Available", "status": "True"}],
    }
    for i in range(ready):
        kube.objects[("Pod", "ml", f"p{i}")] = ready_pod(f"p{i}", f"127.0.0.{11 + i}")


def test_an_invalid_spec_update_keeps_the_observed_state_of_the_running_deployment() -> None:
    kube = FakeKube()
    first = reconcile(make_ctx(kube), body(valid_spec()), now_s=0)
    running(kube, ready=2)
    serving = reconcile(make_ctx(kube), body(valid_spec(), status=first.status), apply=False, now_s=5)
    bad = valid_spec() | {"rollout": {"maxSurge": "abc"}}
    outcome = reconcile(make_ctx(kube), body(bad, status=serving.status, generation=2), now_s=10)
    st = outcome.status
    assert (st["replicas"], st["readyReplicas"], st["observedGeneration"]) == (2, 2, 1)
    conditions = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    assert conditions == {
        "Ready": ("True", "Serving"),
        "Available": ("True", "ReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("True", "InvalidSpec"),
    }
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "spec.rollout.maxSurge: " + (
        "must be a whole number or a percentage such as 25%"
    )
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "InvalidSpec")]


def test_an_object_the_api_server_cannot_type_is_apply_failed_not_an_outage() -> None:
    from corral_operator.kube import Unavailable, _error

    message = (
        "failed to create typed patch object (ml/tiny; apps/v1, Kind=Deployment): "
        ".spec.template.spec.securityContext.foo: field not declared in schema"
    )
    typed = _error(500, json.dumps({"kind": "Status", "message": message, "code": 500}).encode())
    assert isinstance(typed, Invalid) and typed.message == message
    assert isinstance(_error(500, b'{"message": "etcdserver: request timed out"}'), Unavailable)
    kube = FakeKube()
    kube.reject_kind, kube.reject_error = "Deployment", typed
    outcome = reconcile(make_ctx(kube), body(valid_spec()), now_s=0)
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert "securityContext.foo: field not declared in schema" in degraded["message"]
    assert ("Warning", "ApplyFailed") in [(e.type, e.reason) for e in outcome.events]


def test_a_status_refresh_from_a_stale_read_never_moves_observed_generation_back() -> None:
    kube = FakeKube()
    ctx = make_ctx(kube)
    v3 = reconcile(ctx, body(valid_spec(), generation=3), now_s=0).status
    stale = body(valid_spec(), status=v3, generation=4)
    stale["metadata"]["resourceVersion"] = "1"
    # the tick for generation 4 has written its status since the refresh's read
    current = kube.store_cr(body(valid_spec(), status=dict(v3), generation=4))
    current["metadata"]["resourceVersion"] = "2"
    reconcile(ctx, current, now_s=5)
    assert kube.objects[("LLMDeployment", "ml", "tiny")]["status"]["observedGeneration"] == 4
    running(kube, ready=1)  # a Deployment event: pods changed
    kube.writes.clear()
    reconcile(ctx, stale, apply=False, now_s=6)
    assert [w[1]["observedGeneration"] for w in kube.writes if w[0] == "status"] == [4]
    assert kube.objects[("LLMDeployment", "ml", "tiny")]["status"]["observedGeneration"] == 4


def test_two_writers_from_one_read_post_a_transitions_events_once() -> None:
    kube = FakeKube()
    ctx = make_ctx(kube)
    reconcile(ctx, body(valid_spec()), now_s=0)
    running(kube, ready=2)
    # no status yet: both writers read "nothing reported"
    read = copy.deepcopy(kube.store_cr(body(valid_spec())))
    first = reconcile(ctx, read, apply=False, now_s=1)
    second = reconcile(ctx, read, apply=False, now_s=1)
    assert [e.reason for e in first.events] == ["Available"]
    assert second.events == []


def test_the_operators_monitor_settings_reach_each_service_monitor() -> None:
    kube = FakeKube()
    kube.served = frozenset({"ServiceMonitor"})
    ctx = Context(kube=kube, monitor_labels={"release": "kps"}, monitor_interval="1m")  # type: ignore[arg-type]
    reconcile(ctx, body(valid_spec()), now_s=0)
    monitor = kube.objects[("ServiceMonitor", "ml", "tiny")]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["endpoints"][0]["interval"] == "1m"


def test_the_writer_that_records_a_finished_rollout_posts_rolled_out_once() -> None:
    kube = FakeKube()
    ctx = make_ctx(kube)
    reconcile(ctx, body(valid_spec()), now_s=0)
    running(kube, ready=2)
    dep = kube.objects[("Deployment", "ml", "tiny")]
    dep["metadata"]["annotations"] = {"deployment.kubernetes.io/revision": "1"}
    dep["status"]["availableReplicas"] = 2
    read = copy.deepcopy(kube.store_cr(body(valid_spec(), generation=2)))
    assert "RolledOut" not in [e.reason for e in reconcile(ctx, read, apply=False, now_s=1).events]
    dep["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "2"  # new pods, all ready
    read = copy.deepcopy(kube.objects[("LLMDeployment", "ml", "tiny")])
    first = reconcile(ctx, read, apply=False, now_s=2)
    second = reconcile(ctx, read, apply=False, now_s=2)  # the Deployment-event refresh and a tick
    assert [e.reason for e in first.events] == ["RolledOut"]
    assert second.events == []


def test_a_stale_crd_degrades_every_llmdeployment_and_its_status_is_not_rewritten_each_tick() -> None:
    kube = FakeKube()
    kube.schema = copy.deepcopy(expected_schema())
    del kube.schema["properties"]["status"]["properties"]["rolledOutRevision"]  # before that release
    ctx = make_ctx(kube)
    first = reconcile(ctx, kube.store_cr(body(valid_spec())), now_s=0)
    degraded = next(c for c in first.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "StaleCRD")
    assert "lacks status.rolledOutRevision" in degraded["message"]
    assert [(e.type, e.reason) for e in first.events if e.reason == "StaleCRD"] == [("Warning", "StaleCRD")]
    running(kube, ready=2)
    dep = kube.objects[("Deployment", "ml", "tiny")]
    dep["metadata"]["annotations"] = {"deployment.kubernetes.io/revision": "1"}
    dep["status"]["availableReplicas"] = 2
    settled = reconcile(
        ctx, copy.deepcopy(kube.objects[("LLMDeployment", "ml", "tiny")]), apply=False, now_s=1
    )
    assert settled.status["readyReplicas"] == 2 and "rolledOutRevision" not in settled.status
    kube.writes.clear()
    reconcile(ctx, copy.deepcopy(kube.objects[("LLMDeployment", "ml", "tiny")]), apply=False, now_s=2)
    assert [w for w in kube.writes if w[0] == "status"] == []  # it wrote nothing the API would drop


def test_a_newer_crds_defaulted_field_is_ignored_not_an_invalid_spec() -> None:
    kube = FakeKube()
    kube.schema = copy.deepcopy(expected_schema())  # applied before helm upgrade, or an operator rollback
    kube.schema["properties"]["spec"]["properties"]["newKnob"] = {"type": "object", "default": {}}
    spec = valid_spec() | {"newKnob": {}}  # what the API server's default puts in every read
    outcome = reconcile(make_ctx(kube), kube.store_cr(body(spec)), now_s=0)
    assert outcome.spec_error is None
    assert ("Deployment", "ml", "tiny") in kube.objects
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "Healthy"


def test_a_crd_made_newer_under_a_running_operator_is_read_at_once_not_an_invalid_spec(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = FakeKube()
    kube.schema = copy.deepcopy(expected_schema())
    ctx = make_ctx(kube)
    reconcile(ctx, kube.store_cr(body(valid_spec())), now_s=0)  # the schema is read and cached
    kube.schema["properties"]["spec"]["properties"]["newKnob"] = {"type": "object", "default": {}}
    with caplog.at_level(logging.WARNING, logger="corral_operator.context"):
        outcome = reconcile(ctx, kube.store_cr(body(valid_spec() | {"newKnob": {}})), now_s=1)
    assert outcome.spec_error is None
    assert not [e for e in outcome.events if e.reason in ("InvalidSpec", "Recovered")]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "newer than this operator: it ignores spec.newKnob" in caplog.records[0].getMessage()


def test_an_unknown_spec_field_rereads_the_served_schema_at_most_every_few_seconds() -> None:
    kube = FakeKube()
    kube.schema = copy.deepcopy(expected_schema())
    reads = []
    served = kube.served_schema
    kube.served_schema = lambda kind: reads.append(kind) or served(kind)  # type: ignore[method-assign]
    ctx = make_ctx(kube)
    spec = valid_spec() | {"notInAnyCrd": 1}  # an API server without pruning could let one through
    for now_s in (0, 1, 2, SPEC_RECHECK_S + 1.5):
        assert ctx.known_spec(spec, now_s) == spec
    assert len(reads) == 2  # at 0, then once SPEC_RECHECK_S had passed


def test_replicas_outside_the_autoscaling_bounds_never_reach_the_deployment() -> None:
    kube = FakeKube()
    spec = valid_spec() | {"replicas": 8, "autoscaling": {"minReplicas": 1, "maxReplicas": 1}}
    outcome = reconcile(make_ctx(kube), body(spec), now_s=0)
    assert kube.objects[("Deployment", "ml", "tiny")]["spec"]["replicas"] == 1
    assert next(c for c in outcome.status["conditions"] if c["type"] == "Progressing")["message"] == (
        "0/1 updated, 0/1 ready, 0 pods"
    )
