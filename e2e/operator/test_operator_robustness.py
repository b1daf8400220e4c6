"""Bad input and bad luck: invalid manifests rejected by the schema, a killed operator converging,
two operator replicas not fighting."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import yaml
from corral_operator import render
from corral_operator.spec import parse_spec

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import (
    OperatorProcess,
    condition,
    events_of,
    get_llmd,
    is_available,
    llmdeployment,
)
from tests.operator.invalid_cases import INVALID_SPECS, valid_spec

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]


def _manifest(name: str, namespace: str, spec: dict) -> str:
    doc = {
        "apiVersion": "corral.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace},
    }
    return yaml.safe_dump({**doc, "spec": spec})


def test_invalid_manifests_are_rejected_by_the_api_server_with_clear_messages(
    operator_installed: Cluster, k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    cases = [(case, f"bad-{i}", spec, message) for i, (case, spec, message) in enumerate(INVALID_SPECS)]
    cases.append(("name-too-long", "x" * 70, valid_spec(), "metadata.name must be a DNS label"))
    assert len(cases) >= 10
    for case, name, spec, message in cases:
        result = cluster.kubectl("apply", "-f", "-", stdin=_manifest(name, ns, spec), check=False)
        assert result.returncode != 0, f"{case} was accepted"
        assert message in result.stderr, f"{case}: {result.stderr}"
    # the valid base really is valid: the rejections above are about the mutations
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=_manifest("good", ns, valid_spec()))
    # an optional block the schema fills with its defaults
    speculative = valid_spec()
    speculative["engine"]["args"]["speculative"] = {"promptLookupMax": 4}
    result = cluster.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", stdin=_manifest("spec", ns, speculative)
    )
    stored = json.loads(result.stdout)["spec"]["engine"]["args"]["speculative"]
    assert stored == {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 4}
    # a GPU pod may give the engine its share of the card (a CPU pod may not: INVALID_SPECS)
    gpu = valid_spec()
    gpu["engine"]["args"]["gpuMemoryUtilization"] = 0.8
    gpu["resources"] = {"gpu": 1}
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=_manifest("gpu", ns, gpu))
    # a percentage rollout and the pod's own volumes, mounts and env under names of their own
    extras = valid_spec() | {"rollout": {"maxSurge": "25%", "maxUnavailable": 1}}
    extras["pod"] = {
        "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        "env": [{"name": "TMPDIR", "value": "/scratch"}],
        "envFrom": [{"secretRef": {"name": "creds", "optional": True}, "prefix": "APP_"}],
    }
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=_manifest("extras", ns, extras))
    assert cluster.get_json("llmd", "-n", ns)["items"] == []


def _converged(cluster: Cluster, ns: str, names: list[str]) -> bool:
    for name in names:
        cr = get_llmd(cluster, ns, name)
        if not is_available(cr) or cr["status"].get("observedGeneration") != cr["metadata"]["generation"]:
            return False
    return True


def _expected_container(cr: dict) -> dict:
    owner = render.Owner(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["metadata"]["uid"])
    return render.deployment(owner, parse_spec(cr["spec"]))["spec"]["template"]["spec"]["containers"][0]


def test_operator_killed_mid_reconcile_converges_after_restart(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    names = [f"m{i}" for i in range(6)]
    first = start_operator(priority=None)  # the default priority, as the chart runs it
    cluster.apply(yaml.safe_dump_all([llmdeployment(n, ns, replicas=1) for n in names]))
    cluster.wait_until(
        "the first Deployment", lambda: cluster.get_json("deployments", "-n", ns)["items"], timeout_s=60
    )
    first.kill()  # SIGKILL: no clean-up, some objects half done
    # a spec change while no operator runs
    cluster.kubectl("patch", "llmd", "m0", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":2}}')
    restarted = start_operator(priority=None)
    cluster.wait_until("all converged", lambda: _converged(cluster, ns, names), timeout_s=120)
    _forget_dead_peers(cluster)
    # the newer replica outranks the killed one's leftover peering record: no pause behind it
    assert "Pausing operations" not in restarted.log() and "Possibly conflicting" not in restarted.log()
    deployments = cluster.get_json("deployments", "-n", ns)["items"]
    assert sorted(d["metadata"]["name"] for d in deployments) == names
    for dep in deployments:
        cr = get_llmd(cluster, ns, dep["metadata"]["name"])
        assert cr is not None
        container = dep["spec"]["template"]["spec"]["containers"][0]
        expected = _expected_container(cr)
        assert (container["image"], container["command"]) == (expected["image"], expected["command"])
        assert dep["spec"]["replicas"] == cr["spec"]["replicas"]
    assert cluster.get_json("deployment", "m0", "-n", ns)["spec"]["replicas"] == 2


def _forget_dead_peers(cluster: Cluster) -> None:
    """Drop every peering record but the newest (the one running): a killed replica's record lives
    on for kopf's peering lifetime (60 s) and would pause the next test's lower-priority operators."""
    peers = cluster.get_json("clusterkopfpeering", "corral").get("status") or {}
    newest = max(peers.values(), key=lambda p: int(p.get("priority", 0)), default=None)
    stale = {identity: None for identity, peer in peers.items() if peer is not newest}
    if stale:
        cluster.kubectl(
            "patch", "clusterkopfpeering", "corral", "--type=merge", "-p", json.dumps({"status": stale})
        )


def test_two_operator_replicas_do_not_fight(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    low = start_operator(priority=10)
    high = start_operator(priority=20)
    cluster.wait_until(
        "the low-priority replica pauses", lambda: "Pausing operations in favour of" in low.log()
    )
    cluster.apply(yaml.safe_dump(llmdeployment("shared", ns, replicas=2)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "shared")))
    assert f"{ns}/shared" in high.log()
    assert f"{ns}/shared" not in low.log()
    # settled: nobody rewrites the Deployment back and forth
    before = cluster.get_json("deployment", "shared", "-n", ns)["metadata"]
    time.sleep(3 * high.resync_s)
    after = cluster.get_json("deployment", "shared", "-n", ns, "--show-managed-fields")["metadata"]
    assert after["generation"] == before["generation"]
    assert [m["manager"] for m in after["managedFields"] if m["operation"] == "Apply"] == ["corral-operator"]

    # the leader leaves gracefully; the other replica takes over
    high.stop()
    cluster.wait_until(
        "the low-priority replica resumes", lambda: "Resuming operations" in low.log(), timeout_s=90
    )
    cluster.apply(yaml.safe_dump(llmdeployment("after-failover", ns, replicas=1)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "after-failover")))
    assert f"{ns}/after-failover" in low.log()


def test_missing_model_pvc_is_a_degraded_condition_and_an_event_not_a_crash(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    operator = start_operator()
    doc = llmdeployment("no-weights", ns, replicas=1)
    doc["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}}
    cluster.apply(yaml.safe_dump(doc))
    degraded = cluster.wait_until(
        "Degraded",
        lambda: (
            (c := condition(get_llmd(cluster, ns, "no-weights"), "Degraded")).get("status") == "True" and c
        ),
    )
    assert degraded["reason"] == "ModelVolumeMissing"
    assert "'models' not found" in degraded["message"]

    def has_warning() -> bool:
        selector = "involvedObject.name=no-weights"
        events = cluster.get_json("events", "-n", ns, "--field-selector", selector)["items"]
        return any(e["type"] == "Warning" and e["reason"] == "ModelVolumeMissing" for e in events)

    cluster.wait_until("Warning event", has_warning)
    assert not is_available(get_llmd(cluster, ns, "no-weights"))
    time.sleep(2 * operator.resync_s)
    assert operator.is_alive()


def test_a_spec_the_api_server_cannot_type_is_degraded_apply_failed_with_its_message(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    """Server-side apply answers 500 "failed to create typed patch object" for a Deployment that does
    not fit its schema (here a typo inside the pod securityContext, an open object the CRD accepts
    and merges): the spec's mistake, reported in status and an Event, not an outage retried in
    silence."""
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    doc = llmdeployment("bad-pod-spec", ns, replicas=1)
    doc["spec"]["pod"] = {"securityContext": {"foo": "bar"}}
    cluster.apply(yaml.safe_dump(doc))
    degraded = cluster.wait_until(
        "Degraded",
        lambda: (
            (c := condition(get_llmd(cluster, ns, "bad-pod-spec"), "Degraded")).get("status") == "True" and c
        ),
    )
    assert degraded["reason"] == "ApplyFailed"
    assert "securityContext.foo: field not declared in schema" in degraded["message"]
    progressing = condition(get_llmd(cluster, ns, "bad-pod-spec"), "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "ApplyFailed")
    cluster.wait_until(
        "Warning event",
        lambda: any(e["reason"] == "ApplyFailed" for e in events_of(cluster, ns, "bad-pod-spec")),
    )
    # fixed: it rolls out and recovers
    cluster.kubectl("patch", "llmd", "bad-pod-spec", "-n", ns, "--type=json", "-p",
                    '[{"op": "remove", "path": "/spec/pod"}]')  # fmt: skip
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "bad-pod-spec")))
    assert condition(get_llmd(cluster, ns, "bad-pod-spec"), "Degraded")["status"] == "False"


def test_an_event_for_a_model_whose_namespace_is_being_deleted_is_no_error(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    operator = start_operator()
    doc = llmdeployment("held", ns, replicas=1)
    # Another controller's finalizer: the model outlives its Deployment in the terminating namespace.
    doc["metadata"]["finalizers"] = ["example.com/hold"]
    cluster.apply(yaml.safe_dump(doc))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "held")))
    try:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
        cluster.kubectl("delete", "deployment", "held", "-n", ns, "--wait=false", check=False)

        def refused_posts() -> list[str]:
            lines = operator.log().splitlines()
            return [line for line in lines if "posting" in line and "being terminated" in line]

        # The model's status change (its Deployment went) is an Event the API server refuses: kopf
        # retries it, at DEBUG.
        cluster.wait_until("an Event refused", refused_posts)
        assert not [line for line in refused_posts() if " DEBUG " not in line], refused_posts()[:3]
    finally:
        cluster.kubectl(
            "patch", "llmd", "held", "-n", ns, "--type", "merge", "-p", '{"metadata":{"finalizers":null}}'
        )
