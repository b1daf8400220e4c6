"""Smoke tests of the e2e control plane: workloads run on kwok nodes, controllers act, RBAC bites."""

from __future__ import annotations

import ipaddress
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from e2e.k8s.cluster import OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT, Cluster
from e2e.k8s.manifests import GPU_RESOURCE, LOOPBACK_NETWORK

pytestmark = pytest.mark.k8s

# kwok never pulls images; the reserved .invalid domain makes sure nothing else could either.
IMAGE = "corral.invalid/fake-engine:0"


def deployment_yaml(name: str, *, replicas: int = 2, gpus: int = 0) -> str:
    container: dict[str, Any] = {
        "name": "engine",
        "image": IMAGE,
        "ports": [{"containerPort": 8000, "name": "http"}],
    }
    if gpus:
        container["resources"] = {"limits": {GPU_RESOURCE: gpus}}
    labels = {"app": name}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
    return yaml.safe_dump(deployment)


def service_yaml(name: str) -> str:
    spec = {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": "http"}]}
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec})


def pods(cluster: Cluster, namespace: str, app: str) -> list[dict]:
    items: list[dict] = cluster.get_json("pods", "-n", namespace, "-l", f"app={app}")["items"]
    return items


def run_deployment(cluster: Cluster, namespace: str, name: str, **kwargs: int) -> list[dict]:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=deployment_yaml(name, **kwargs))
    cluster.kubectl("rollout", "status", "-n", namespace, f"deployment/{name}", "--timeout=90s")
    return pods(cluster, namespace, name)


def versions() -> dict[str, str]:
    text = Path(__file__).with_name("versions.env").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_server_reports_the_pinned_kubernetes_version(k8s_cluster: Cluster) -> None:
    info = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)
    assert info["serverVersion"]["gitVersion"] == versions()["KUBERNETES_VERSION"]
    assert info["clientVersion"]["gitVersion"] == versions()["KUBERNETES_VERSION"]


def test_deployment_runs_pods_on_fake_nodes_with_loopback_ips(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    running = run_deployment(k8s_cluster, k8s_namespace, "web", replicas=2)

    replica_sets = k8s_cluster.get_json("replicasets", "-n", k8s_namespace, "-l", "app=web")["items"]
    assert [rs["metadata"]["ownerReferences"][0]["name"] for rs in replica_sets] == ["web"]
    assert len(running) == 2
    fake_nodes = {n.name for n in k8s_cluster.nodes}
    for pod in running:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"] in fake_nodes
        assert pod["metadata"]["ownerReferences"][0]["name"] == replica_sets[0]["metadata"]["name"]
        assert ipaddress.ip_address(pod["status"]["podIP"]) in LOOPBACK_NETWORK
        assert ipaddress.ip_address(pod["status"]["hostIP"]) in LOOPBACK_NETWORK


def test_gpu_pod_is_scheduled_on_the_gpu_node(k8s_cluster: Cluster, k8s_namespace: str) -> None:
    gpu_nodes = {n.name for n in k8s_cluster.nodes if n.num_gpus > 0}

    running = run_deployment(k8s_cluster, k8s_namespace, "gpu", replicas=1, gpus=1)

    assert [p["spec"]["nodeName"] for p in running] == sorted(gpu_nodes)[:1]


def test_deleting_a_deployment_garbage_collects_its_pods(k8s_cluster: Cluster, k8s_namespace: str) -> None:
    assert len(run_deployment(k8s_cluster, k8s_namespace, "doomed", replicas=2)) == 2

    k8s_cluster.kubectl("delete", "-n", k8s_namespace, "deployment/doomed", "--cascade=background")

    k8s_cluster.wait_until("pods collected", lambda: not pods(k8s_cluster, k8s_namespace, "doomed"))
    assert k8s_cluster.get_json("replicasets", "-n", k8s_namespace)["items"] == []


def endpoint_slices_or_none(cluster: Cluster, namespace: str, service: str) -> list[dict] | None:
    return cluster.assert_endpoint_slices_loopback(namespace, service) or None


def test_service_without_ready_pods_gets_a_placeholder_endpoint_slice(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    k8s_cluster.apply(service_yaml("idle"), namespace=k8s_namespace)

    slices = k8s_cluster.wait_until(
        "EndpointSlice for idle", lambda: endpoint_slices_or_none(k8s_cluster, k8s_namespace, "idle")
    )

    assert [s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] for s in slices] == [
        "endpointslice-controller.k8s.io"
    ]
    assert slices[0]["endpoints"] in (None, [])


def test_api_server_refuses_loopback_endpoint_slice_addresses(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    """Pins a real-API-server limit the design must live with: EndpointSlice validation rejects
    127.0.0.0/8, so Pods with loopback IPs never appear in EndpointSlices. Discovery of loopback
    replicas in e2e has to read Pods (their podIP is loopback) rather than EndpointSlices."""
    run_deployment(k8s_cluster, k8s_namespace, "web", replicas=1)

    k8s_cluster.apply(service_yaml("web"), namespace=k8s_namespace)

    def refusal() -> str | None:
        events = k8s_cluster.get_json(
            "events", "-n", k8s_namespace, "--field-selector", "involvedObject.name=web"
        )
        messages = [e["message"] for e in events["items"] if e["reason"] == "FailedToUpdateEndpointSlices"]
        return next((m for m in messages if "may not be in the loopback range" in m), None)

    assert k8s_cluster.wait_until("EndpointSlice refusal", refusal)
    assert k8s_cluster.assert_endpoint_slices_loopback(k8s_namespace, "web") == []


def test_loopback_guard_flags_a_non_loopback_endpoint_slice(k8s_cluster: Cluster, k8s_namespace: str) -> None:
    # 192.0.2.0/24 is TEST-NET-1 (documentation only); the object is only stored, never dialed.
    k8s_cluster.apply(
        textwrap.dedent(
            """\
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: foreign-1, labels: {kubernetes.io/service-name: foreign}}
            addressType: IPv4
            endpoints: [{addresses: [192.0.2.10]}]
            ports: [{port: 80}]
            """
        ),
        namespace=k8s_namespace,
    )

    with pytest.raises(AssertionError, match=r"192\.0\.2\.10"):
        k8s_cluster.assert_endpoint_slices_loopback(k8s_namespace, "foreign")


def test_helm_installs_a_chart_that_requires_the_cluster_version(
    k8s_cluster: Cluster, k8s_namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    # Helm checks kubeVersion against the server's gitVersion: an unstamped v0.0.0-master would fail it.
    (chart / "Chart.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v2", "name": "probe", "version": "0.1.0", "kubeVersion": ">=1.34.0-0"})
    )
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: '{{ .Release.Name }}-probe'}\ndata: {ok: 'yes'}\n"
    )

    version = k8s_cluster.helm("version", "--template", "{{.Version}}").stdout
    k8s_cluster.helm("install", "probe", str(chart), "-n", k8s_namespace, "--wait", "--timeout=60s")

    assert version == versions()["HELM_VERSION"]
    assert k8s_cluster.get_json("configmap", "probe-probe", "-n", k8s_namespace)["data"] == {"ok": "yes"}


def test_operator_identity_gets_only_what_its_role_grants(
    k8s_cluster: Cluster, operator_kubeconfig: Path
) -> None:
    k8s_cluster.ensure_namespace(OPERATOR_NAMESPACE)
    denied = k8s_cluster.kubectl(
        "get", "pods", "-n", OPERATOR_NAMESPACE, kubeconfig=operator_kubeconfig, check=False
    )
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr

    kubeconfig = k8s_cluster.apply_operator_rbac(
        textwrap.dedent(
            f"""\
            apiVersion: rbac.authorization.k8s.io/v1
            kind: Role
            metadata: {{name: pod-reader, namespace: {OPERATOR_NAMESPACE}}}
            rules:
            - {{apiGroups: [""], resources: [pods], verbs: [get, list, watch]}}
            ---
            apiVersion: rbac.authorization.k8s.io/v1
            kind: RoleBinding
            metadata: {{name: pod-reader, namespace: {OPERATOR_NAMESPACE}}}
            roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}}
            subjects:
            - {{kind: ServiceAccount, name: {OPERATOR_SERVICE_ACCOUNT}, namespace: {OPERATOR_NAMESPACE}}}
            """
        )
    )
    assert kubeconfig == operator_kubeconfig

    def can_i(*args: str) -> str:
        result = k8s_cluster.kubectl("auth", "can-i", *args, kubeconfig=operator_kubeconfig, check=False)
        return result.stdout.strip()

    assert k8s_cluster.wait_until(
        "RBAC to apply", lambda: can_i("list", "pods", "-n", OPERATOR_NAMESPACE) == "yes"
    )
    k8s_cluster.kubectl("get", "pods", "-n", OPERATOR_NAMESPACE, kubeconfig=operator_kubeconfig)
    assert can_i("create", "deployments", "-n", OPERATOR_NAMESPACE) == "no"
    assert can_i("list", "pods", "-n", "default") == "no"
    assert can_i("list", "secrets", "-n", OPERATOR_NAMESPACE) == "no"


def test_kubeconfig_for_any_user_authenticates_as_that_user(k8s_cluster: Cluster) -> None:
    kubeconfig = k8s_cluster.kubeconfig_for("alice", groups=["corral-testers"])

    whoami = json.loads(k8s_cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout)

    assert whoami["status"]["userInfo"]["username"] == "alice"
    assert "corral-testers" in whoami["status"]["userInfo"]["groups"]
    denied = k8s_cluster.kubectl("get", "namespaces", kubeconfig=kubeconfig, check=False)
    assert "Forbidden" in denied.stderr


def test_python_kubernetes_client_works_with_the_kubeconfigs(
    k8s_cluster: Cluster, operator_kubeconfig: Path
) -> None:
    with config.new_client_from_config(config_file=str(k8s_cluster.admin_kubeconfig)) as admin:
        names = {ns.metadata.name for ns in client.CoreV1Api(admin).list_namespace().items if ns.metadata}
    with (
        config.new_client_from_config(config_file=str(operator_kubeconfig)) as operator,
        pytest.raises(ApiException) as denied,
    ):
        client.CoreV1Api(operator).list_namespace()

    assert {"default", "kube-system"} <= names
    assert denied.value.status == 403
