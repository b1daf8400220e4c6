"""Kubernetes discovery against the real API server: a Pod labelled by model, a real engine on its IP;
then two namespaces, each watched with nothing but the chart's Role there.

EndpointSlices cannot carry the e2e cluster's loopback pod IPs (the API server refuses them), so the
gateway watches Pods here (`kubernetes.source: pods`); the EndpointSlice translation is unit-tested.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from corral_engine import wire

from e2e.gateway.conftest import MODEL, start_gateway, wait_for
from e2e.k8s.cluster import Cluster
from e2e.operator.harness import llmdeployment
from e2e.procs import ManagedProcess, free_port

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

LABELS = {"app.kubernetes.io/managed-by": "corral-operator", "corral.dev/model": MODEL}


CHART = Path(__file__).resolve().parents[2] / "charts" / "corral"
# The chart's gateway ServiceAccount for release `corral` in corral-system, as its pods authenticate.
GATEWAY_USER = "system:serviceaccount:corral-system:corral-gateway"
GATEWAY_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:corral-system")


def pod_yaml(name: str, port: int, owner: str | None = None) -> str:
    container = {
        "name": "engine",
        "image": "corral.invalid/engine:0",
        "ports": [{"name": "http", "containerPort": port}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": LABELS | ({wire.INSTANCE_LABEL: owner} if owner else {})},
        "spec": {"containers": [container]},
    }
    return yaml.safe_dump(pod)


def ready_pod_ip(cluster: Cluster, namespace: str, name: str) -> str | None:
    pod: dict[str, Any] = cluster.get_json("pod", name, "-n", namespace)
    status = pod.get("status") or {}
    is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
    return status.get("podIP") if is_ready else None


@contextmanager
def another_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-{secrets.token_hex(4)}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextmanager
def engine_in_pod(
    cluster: Cluster, namespace: str, model_dir: Path, log_dir: Path, owner: str | None = None
) -> Iterator[ManagedProcess]:
    """Pod engine-0 in `namespace` (of LLMDeployment `owner`), and a real engine on the Pod's IP."""
    port = free_port()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=pod_yaml("engine-0", port, owner))
    pod_ip = cluster.wait_until("pod ready", lambda: ready_pod_ip(cluster, namespace, "engine-0"))
    argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(model_dir)]
    argv += ["--host", pod_ip, "--port", str(port), "--served-model-name", MODEL]
    with ManagedProcess(argv, port, name=f"engine-{namespace}", log_dir=log_dir) as engine:
        engine.url = f"http://{pod_ip}:{port}"
        engine.wait_ready(120)
        yield engine


def all_replicas(gateway: ManagedProcess) -> dict[str, list[str]]:
    models = httpx.get(gateway.url + "/corral/replicas", timeout=5).json()["models"]
    return {model: sorted(r["url"] for r in replicas) for model, replicas in models.items()}


def gateway_replicas(gateway: ManagedProcess) -> list[str]:
    return all_replicas(gateway).get(MODEL, [])


def test_gateway_discovers_pods_and_routes_to_the_engine(
    k8s_crds: Cluster, k8s_namespace: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    k8s_cluster = k8s_crds
    with engine_in_pod(k8s_cluster, k8s_namespace, tiny_model_dir, tmp_path) as engine:
        discovery = {
            "enabled": True,
            "source": "pods",
            "namespace": k8s_namespace,  # the older one-namespace form
            "kubeconfig": str(k8s_cluster.admin_kubeconfig),
        }
        with start_gateway({}, tmp_path, kubernetes=discovery) as gateway:
            wait_for("discovery", lambda: gateway_replicas(gateway) == [engine.url])
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
            assert engine.metric("vllm:request_success_total") >= 1
            # The replica leaves when its Pod goes, without a gateway restart.
            k8s_cluster.kubectl("delete", "pod", "engine-0", "-n", k8s_namespace, "--wait=false")
            wait_for("the replica to leave", lambda: gateway_replicas(gateway) == [])
            assert gateway.proc.poll() is None


def test_gateway_watches_each_namespace_of_a_namespaced_operator_with_a_role_there(
    k8s_crds: Cluster, k8s_namespace: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """operator.namespaces [A, B]: the chart gives the gateway a Role in A and in B only, and settings
    that name both; models in both are routed. The same name served in both is asked for as
    NAMESPACE/NAME."""
    cluster = k8s_crds
    with another_namespace(cluster) as second:
        first = k8s_namespace
        rendered = cluster.helm(
            "template", "corral", str(CHART), "--namespace", "corral-system",
            "--show-only", "templates/role-gateway.yaml", "--show-only", "templates/rolebinding-gateway.yaml",
            "--show-only", "templates/configmap-gateway.yaml",
            "--set", "gateway.discovery.source=pods", "--set", f"operator.namespaces={{{first},{second}}}",
        ).stdout  # fmt: skip
        objects = [o for o in yaml.safe_load_all(rendered) if o]
        cluster.apply(yaml.safe_dump_all([o for o in objects if o["kind"] in ("Role", "RoleBinding")]))
        (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
        discovery = yaml.safe_load(config_map["data"]["gateway.yaml"])["kubernetes"]
        assert discovery["namespaces"] == [first, second]
        kubeconfig = cluster.kubeconfig_for(GATEWAY_USER, GATEWAY_GROUPS)

        def can_i(*args: str) -> str:
            return cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False).stdout.strip()

        for ns in (first, second):
            cluster.wait_until(
                f"the Role in {ns} applies", lambda ns=ns: can_i("watch", "pods", "-n", ns) == "yes"
            )
        assert can_i("list", "pods", "--all-namespaces") == "no"
        for ns in (first, second):
            cluster.apply(yaml.safe_dump(llmdeployment("tiny", ns, replicas=1)))
        settings = {**discovery, "kubeconfig": str(kubeconfig)}
        with (
            engine_in_pod(cluster, first, tiny_model_dir, tmp_path, owner="tiny") as engine_a,
            engine_in_pod(cluster, second, tiny_model_dir, tmp_path, owner="tiny") as engine_b,
            start_gateway({}, tmp_path, kubernetes=settings) as gateway,
        ):
            both = {f"{first}/{MODEL}": [engine_a.url], f"{second}/{MODEL}": [engine_b.url]}
            wait_for("discovery in both namespaces", lambda: all_replicas(gateway) == both)
            for model, engine in ((f"{first}/{MODEL}", engine_a), (f"{second}/{MODEL}", engine_b)):
                body = {"model": model, "prompt": "hello", "max_tokens": 4}
                response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
                assert response.status_code == 200, response.text
                assert engine.metric("vllm:request_success_total") >= 1
            bare = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            response = httpx.post(gateway.url + "/v1/completions", json=bare, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["code"] == "model_ambiguous"
            # An event in one namespace leaves the other's replicas alone.
            cluster.kubectl("delete", "pod", "engine-0", "-n", first, "--wait=false")
            after = {f"{first}/{MODEL}": [], f"{second}/{MODEL}": [engine_b.url]}
            wait_for("the first namespace's replica to leave", lambda: all_replicas(gateway) == after)
            assert gateway.proc.poll() is None
