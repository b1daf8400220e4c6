"""reconcile() and autoscale() against an in-memory API (the real one is exercised in e2e/operator)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
from corral_operator import labels
from corral_operator.autoscaler import Load, State
from corral_operator.context import Context
from corral_operator.kube import Invalid
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

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.writes.append(("status", dict(status)))

    def patch_replicas(self, namespace: str, name: str, replicas: int) -> None:
        self.writes.append(("replicas", replicas))

    crds: frozenset[str] = frozenset()

    def crd_exists(self, name: str) -> bool:
        return name in self.crds


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
    reconcile(make_ctx(kube), body(valid_spec()), now_s=0)
    one = valid_spec() | {"replicas": 1}
    # owner references carry the CR's uid; only objects owned by this CR are pruned
    outcome = reconcile(make_ctx(kube), body(one, generation=2), now_s=1)
    assert ("PodDisruptionBudget", "ml", "tiny") not in kube.objects
    assert ("delete", "PodDisruptionBudget") in kube.writes
    assert [e.reason for e in outcome.events if e.reason == "Pruned"] == ["Pruned"]


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
    handlers.on_timer(body=cr, memo=memo, logger=logger)
    status_writes = [w[1] for w in kube.writes if w[0] == "status"]
    assert len(status_writes) == 1 and "lastScaleTime" in status_writes[0]
    assert memo["recorded"] == {}


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
    kube.crds = frozenset({"scaledobjects.keda.sh"})
    outcome = reconcile(make_ctx(kube), body(spec), now_s=100)
    assert ("ScaledObject", "ml", "tiny") in kube.objects
    assert next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")["status"] == "False"
