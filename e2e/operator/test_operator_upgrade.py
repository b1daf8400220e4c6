"""An upgrade as a platform team runs it: an operator started on an LLMDeployment CRD older than
itself says so; the CRD applied and the operator restarted, what runs is kept (same children, same
pods) and an edited LLMDeployment is applied in place."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from corral_operator.crd import build_crd
from corral_operator.handlers import FINALIZER, OLD_FINALIZER

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import (
    ROOT,
    OperatorProcess,
    condition,
    events_of,
    get_llmd,
    is_available,
    llmdeployment,
    running_pods,
)

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]
CURRENT_CRD = ROOT / "crds" / "corral.dev_llmdeployments.yaml"
NEW_STATUS_FIELDS = ("rolledOutRevision", "rolledOutGeneration")  # what the older CRD lacks
FIX = "kubectl apply --server-side -f charts/corral/crds/"
FUTURE_FIELD = "futureField"  # what a newer CRD adds, with a default


def older_crd() -> dict[str, Any]:
    crd = copy.deepcopy(build_crd())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    for name in NEW_STATUS_FIELDS:
        del status["properties"][name]
    return crd


def serves_status_field(cluster: Cluster, name: str) -> bool:
    """Whether the API server publishes (and so prunes with) a schema that has status.<name>."""
    raw = cluster.kubectl("get", "--raw", "/openapi/v3/apis/corral.dev/v1alpha1").stdout
    schema = json.loads(raw)["components"]["schemas"]["dev.corral.v1alpha1.LLMDeployment"]
    return name in schema["properties"]["status"]["properties"]


@pytest.fixture
def older_crd_installed(operator_installed: Cluster) -> Iterator[Cluster]:
    cluster = operator_installed
    cluster.apply(yaml.safe_dump(older_crd()))
    cluster.wait_until("older CRD served", lambda: not serves_status_field(cluster, "rolledOutRevision"))
    try:
        yield cluster
    finally:  # later tests run on this release's CRD
        cluster.apply(CURRENT_CRD)
        cluster.wait_until("current CRD served", lambda: serves_status_field(cluster, "rolledOutRevision"))


def uids(cluster: Cluster, ns: str, name: str) -> dict[str, str]:
    out = {
        k: cluster.get_json(k, name, "-n", ns)["metadata"]["uid"] for k in ("deployment", "service", "pdb")
    }
    for pod in running_pods(cluster, ns, name):
        restarts = sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or ())
        out[f"pod/{pod['metadata']['name']}"] = f"{pod['metadata']['uid']} restarts={restarts}"
    return out


def test_a_stale_crd_is_reported_and_an_upgrade_keeps_what_runs(
    older_crd_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = older_crd_installed, k8s_namespace
    old = start_operator(priority=None)
    cluster.apply(yaml.safe_dump(llmdeployment("up", ns, replicas=1)))

    def degraded_reason() -> str | None:
        """Degraded's reason once the model serves (StaleCRD comes after the model's own problems)."""
        cr = get_llmd(cluster, ns, "up")
        return (
            condition(cr, "Degraded").get("reason")
            if condition(cr, "Available").get("status") == "True"
            else None
        )

    cluster.wait_until("StaleCRD on a serving model", lambda: degraded_reason() == "StaleCRD")
    message = condition(get_llmd(cluster, ns, "up"), "Degraded")["message"]
    assert "lacks status.rolledOutRevision, status.rolledOutGeneration" in message and FIX in message
    errors = [line for line in old.log().splitlines() if " ERROR corral_operator" in line]
    assert len(errors) == 1 and "older than this operator" in errors[0] and FIX in errors[0]
    assert not any(f in (get_llmd(cluster, ns, "up") or {})["status"] for f in NEW_STATUS_FIELDS)
    before = uids(cluster, ns, "up")

    # The documented fix, then a new operator pod: the model recovers and nothing is recreated.
    old.stop()
    cluster.apply(CURRENT_CRD)
    cluster.wait_until("current CRD served", lambda: serves_status_field(cluster, "rolledOutRevision"))
    start_operator(priority=None)
    cluster.wait_until("Recovered", lambda: degraded_reason() == "Healthy")
    cluster.wait_until(
        "rolledOutRevision", lambda: (get_llmd(cluster, ns, "up") or {})["status"].get("rolledOutRevision")
    )
    assert [e["message"] for e in events_of(cluster, ns, "up") if e["reason"] == "Recovered"] == [
        "no longer degraded (StaleCRD)"
    ]
    assert uids(cluster, ns, "up") == before

    # `kubectl apply` of an edited manifest (labels, rollout settings): applied in place, no new pods.
    edited = llmdeployment("up", ns, replicas=1)
    edited["metadata"]["labels"] = {"team": "search"}
    edited["spec"]["rollout"] = {"maxSurge": 2}
    cluster.apply(yaml.safe_dump(edited))

    def strategy_surge() -> int | None:
        return cluster.get_json("deployment", "up", "-n", ns)["spec"]["strategy"]["rollingUpdate"]["maxSurge"]

    cluster.wait_until("maxSurge applied", lambda: strategy_surge() == 2)
    assert uids(cluster, ns, "up") == before
    # Generation 2 settled and recorded first, or the restart's rollout would seem to carry it.
    cluster.wait_until(
        "generation 2 recorded",
        lambda: (get_llmd(cluster, ns, "up") or {})["status"].get("rolledOutGeneration") == 2,
    )

    # A restart of the same spec: RolledOut names the Deployment revision, not the unchanged generation.
    cluster.kubectl("rollout", "restart", "deployment/up", "-n", ns)

    def rolled_out() -> list[str]:
        return [e["message"] for e in events_of(cluster, ns, "up") if e["reason"] == "RolledOut"]

    cluster.wait_until("RolledOut", lambda: rolled_out() or None)
    assert rolled_out() == ["Deployment revision 2: 1/1 replicas run the new pods and are ready"]


def newer_crd() -> dict[str, Any]:
    """This release's CRD plus a spec field the operator does not know, defaulted by the schema."""
    crd = copy.deepcopy(build_crd())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"][FUTURE_FIELD] = {"type": "string", "default": "on"}
    return crd


@pytest.fixture
def restore_crd(operator_installed: Cluster) -> Iterator[Cluster]:
    cluster = operator_installed
    try:
        yield cluster
    finally:  # later tests run on this release's CRD
        cluster.apply(CURRENT_CRD)
        cluster.wait_until("current CRD served", lambda: not serves_spec_field(cluster, FUTURE_FIELD))


def serves_spec_field(cluster: Cluster, name: str) -> bool:
    raw = cluster.kubectl("get", "--raw", "/openapi/v3/apis/corral.dev/v1alpha1").stdout
    schema = json.loads(raw)["components"]["schemas"]["dev.corral.v1alpha1.LLMDeployment"]
    return name in schema["properties"]["spec"]["properties"]


def test_describe_shows_no_bookkeeping_and_a_newer_crd_is_no_users_change(
    restore_crd: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = restore_crd, k8s_namespace
    first = start_operator()
    cluster.apply(yaml.safe_dump(llmdeployment("desc", ns, replicas=1)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "desc")))
    described = cluster.kubectl("describe", "llmd", "desc", "-n", ns).stdout
    annotations = (get_llmd(cluster, ns, "desc") or {})["metadata"].get("annotations") or {}
    assert not [k for k in annotations if "kopf" in k or k.startswith("operator.corral.dev/")], annotations
    assert "last-handled-configuration" not in described and '{"' not in described, described

    # A newer CRD (applied before the operator is upgraded, or with the operator rolled back): the
    # API server serves the object with the field defaulted, at the same generation.
    first.stop()
    cluster.apply(yaml.safe_dump(newer_crd()))
    cluster.wait_until("newer CRD served", lambda: serves_spec_field(cluster, FUTURE_FIELD))
    cluster.wait_until(
        "defaulted field served",
        lambda: (get_llmd(cluster, ns, "desc") or {})["spec"].get(FUTURE_FIELD) == "on",
    )
    second = start_operator()
    # Then a user's change: kopf handles an object's events in order, so its Event comes after any
    # the defaulted field caused.
    edited = llmdeployment("desc", ns, replicas=1)
    edited["spec"]["rollout"] = {"maxSurge": 2}
    cluster.apply(yaml.safe_dump(edited))

    def updated() -> list[str]:
        return [e["message"] for e in events_of(cluster, ns, "desc") if e["reason"] == "Updated"]

    cluster.wait_until("the user's change noted", lambda: updated() or None)
    assert updated() == ["generation 2: rollout strategy changed"]
    # The API server answers 429 to watches while it re-initialises after a CRD update: kopf retries.
    throttled = [line for line in (first.log() + second.log()).splitlines() if "TooManyRequests" in line]
    assert not [line for line in throttled if " ERROR " in line], "\n".join(throttled)


def test_a_newer_crd_applied_under_a_running_operator_is_no_invalid_spec(
    restore_crd: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = restore_crd, k8s_namespace
    operator = start_operator()
    cluster.apply(yaml.safe_dump(llmdeployment("newer", ns, replicas=1)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "newer")))
    cluster.apply(yaml.safe_dump(newer_crd()))  # the operator read the served schema a moment ago
    cluster.wait_until(
        "the newer CRD's field ignored",
        lambda: "newer than this operator: it ignores spec.futureField" in operator.log(),
    )
    cluster.wait_until(  # the ticks on the defaulted spec
        "defaulted field served", lambda: (get_llmd(cluster, ns, "newer") or {})["spec"].get(FUTURE_FIELD)
    )
    reasons = [e["reason"] for e in events_of(cluster, ns, "newer")]
    assert "InvalidSpec" not in reasons and "Recovered" not in reasons, reasons
    assert condition(get_llmd(cluster, ns, "newer"), "Degraded")["reason"] == "Healthy"
    errors = [line for line in operator.log().splitlines() if " ERROR " in line]
    assert not errors, "\n".join(errors)


def test_an_older_operators_finalizer_is_replaced_and_deleting_never_hangs(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    # What an operator before the Corral finalizer left: its kopf finalizer on every LLMDeployment,
    # and a deletion that waits for an operator.
    for name in ("kept", "going"):
        manifest = llmdeployment(name, ns, replicas=1)
        manifest["metadata"]["finalizers"] = [OLD_FINALIZER]
        cluster.apply(yaml.safe_dump(manifest))
    cluster.kubectl("delete", "llmd", "going", "-n", ns, "--wait=false")
    assert (get_llmd(cluster, ns, "going") or {})["metadata"].get("deletionTimestamp")

    start_operator()
    cluster.wait_until("the pending deletion done", lambda: get_llmd(cluster, ns, "going") is None)
    cluster.wait_until(
        "the Corral finalizer instead",
        lambda: (get_llmd(cluster, ns, "kept") or {})["metadata"].get("finalizers") == [FINALIZER],
    )
    cluster.kubectl("delete", "llmd", "kept", "-n", ns, "--timeout=60s")  # returns once it is gone
    assert get_llmd(cluster, ns, "kept") is None
