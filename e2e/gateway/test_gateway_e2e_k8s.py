"""Kubernetes discovery against the real API server: a Pod labelled by model, a real engine on its IP.

EndpointSlices cannot carry the e2e cluster's loopback pod IPs (the API server refuses them), so the
gateway watches Pods here (`kubernetes.source: pods`); the EndpointSlice translation is unit-tested.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.gateway.conftest import MODEL, start_gateway, wait_for
from e2e.k8s.cluster import Cluster
from e2e.procs import ManagedProcess, free_port

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

LABELS = {"app.kubernetes.io/managed-by": "corral-operator", "corral.dev/model": MODEL}


def pod_yaml(name: str, port: int) -> str:
    container = {
        "name": "engine",
        "image": "corral.invalid/engine:0",
        "ports": [{"name": "http", "containerPort": port}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": LABELS},
        "spec": {"containers": [container]},
    }
    return yaml.safe_dump(pod)


def ready_pod_ip(cluster: Cluster, namespace: str, name: str) -> str | None:
    pod: dict[str, Any] = cluster.get_json("pod", name, "-n", namespace)
    status = pod.get("status") or {}
    is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
    return status.get("podIP") if is_ready else None


def gateway_replicas(gateway: ManagedProcess) -> list[str]:
    models = httpx.get(gateway.url + "/corral/replicas", timeout=5).json()["models"]
    return [r["url"] for r in models.get(MODEL, [])]


def test_gateway_discovers_pods_and_routes_to_the_engine(
    k8s_crds: Cluster, k8s_namespace: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    k8s_cluster = k8s_crds
    port = free_port()
    k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", stdin=pod_yaml("engine-0", port))
    pod_ip = k8s_cluster.wait_until("pod ready", lambda: ready_pod_ip(k8s_cluster, k8s_namespace, "engine-0"))
    argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(tiny_model_dir)]
    argv += ["--host", pod_ip, "--port", str(port), "--served-model-name", MODEL]
    with ManagedProcess(argv, port, name="engine", log_dir=tmp_path) as engine:
        engine.url = f"http://{pod_ip}:{port}"
        engine.wait_ready(120)
        discovery = {
            "enabled": True,
            "source": "pods",
            "namespace": k8s_namespace,
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
