"""`helm install` of charts/corral into the real control plane, then the chart's operator and gateway
at work with exactly the RBAC the chart installed, and `helm test` passing against them.

kwok runs the chart's pods only on paper, so the operator and the gateway also run here as processes,
with the arguments and settings the chart gave their pods and the identities of the chart's
ServiceAccounts (client certificates for those users, bound only by the chart's RBAC). An example
LLMDeployment reconciles to Available; a real engine listens on one of its pods' loopback addresses,
and the gateway, discovering pods as the chart configured it, serves a chat completion from it.
Every address dialled is in 127.0.0.0/8.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from corral_operator import labels

from e2e.k8s.cluster import Cluster
from e2e.procs import ManagedProcess, free_port

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "corral"
EXAMPLE = ROOT / "examples" / "tiny-llama.yaml"
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str

    def identity(self, component: str) -> tuple[str, tuple[str, ...]]:
        """The user and groups a pod of the chart's `component` ServiceAccount authenticates as."""
        user = f"system:serviceaccount:{self.namespace}:{self.name}-{component}"
        return user, ("system:serviceaccounts", f"system:serviceaccounts:{self.namespace}")


@contextlib.contextmanager
def installed(cluster: Cluster, *settings: str) -> Iterator[Release]:
    """`helm install --wait` of the chart under a fresh name and namespace; uninstalled afterwards."""
    suffix = secrets.token_hex(3)
    rel = Release(f"corral-{suffix}", f"corral-chart-{suffix}")
    args = [f"--set={s}" for s in ("operator.resyncSeconds=2", *settings)]
    cluster.helm(
        "install", rel.name, str(CHART), "--namespace", rel.namespace, "--create-namespace", *args,
        "--wait", "--timeout=180s",
    )  # fmt: skip
    try:
        yield rel
    finally:
        cluster.helm("uninstall", rel.name, "--namespace", rel.namespace, check=False)
        cluster.kubectl("delete", "namespace", rel.namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def release(k8s_cluster: Cluster) -> Iterator[Release]:
    # Loopback pod IPs never reach EndpointSlices on this API server (e2e/k8s/README.md): discover pods.
    with installed(k8s_cluster, "gateway.discovery.source=pods") as rel:
        yield rel


@contextlib.contextmanager
def chart_operator(cluster: Cluster, rel: Release, log_dir: Path) -> Iterator[ManagedProcess]:
    """`corral operator` with the chart's arguments and its ServiceAccount's identity; on the way out,
    checks it never hit an RBAC denial."""
    kubeconfig = cluster.kubeconfig_for(*rel.identity("operator"))
    liveness_port = free_port()
    argv = _operator_argv(cluster, rel, kubeconfig, liveness_port)
    env = _operator_env(cluster, rel)
    with ManagedProcess(
        argv, liveness_port, name="operator", health_path="/healthz", log_dir=log_dir, env=env
    ) as op:
        op.wait_ready(60)
        yield op
        log = op.log_tail(200_000)
    forbidden = [line for line in log.splitlines() if "forbidden: User" in line]
    assert not forbidden, "the operator hit RBAC denials:\n" + "\n".join(forbidden[:10])


def _deployment(cluster: Cluster, rel: Release, component: str) -> dict[str, Any]:
    return cluster.get_json("deployment", f"{rel.name}-{component}", "-n", rel.namespace)


def _can_i(cluster: Cluster, kubeconfig: Path, *args: str) -> bool:
    result = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
    return result.stdout.strip() == "yes"


def test_chart_installs_crds_and_its_pods_come_up(k8s_cluster: Cluster, release: Release) -> None:
    crds = k8s_cluster.get_json("crd")["items"]
    assert {"llmdeployments.corral.dev", "clusterkopfpeerings.kopf.dev"} <= {
        c["metadata"]["name"] for c in crds
    }
    for component in ("operator", "gateway"):
        status = _deployment(k8s_cluster, release, component)["status"]
        assert status.get("readyReplicas") == 2, (component, status)
    k8s_cluster.get_json("clusterkopfpeering", release.name)
    maps = k8s_cluster.get_json("configmap", "-n", release.namespace, "-l", "grafana_dashboard=1")["items"]
    assert len(maps) == 2


def test_chart_rbac_grants_what_each_component_needs_and_no_more(
    k8s_cluster: Cluster, release: Release, k8s_namespace: str
) -> None:
    operator = k8s_cluster.kubeconfig_for(*release.identity("operator"))
    gateway = k8s_cluster.kubeconfig_for(*release.identity("gateway"))
    ns = ["-n", k8s_namespace]
    assert _can_i(k8s_cluster, operator, "create", "deployments.apps", *ns)
    assert _can_i(k8s_cluster, operator, "patch", "llmdeployments.corral.dev/status", *ns)
    assert _can_i(k8s_cluster, operator, "patch", "clusterkopfpeerings.kopf.dev")
    assert not _can_i(k8s_cluster, operator, "get", "secrets", *ns)
    assert not _can_i(k8s_cluster, operator, "create", "pods", *ns)
    assert _can_i(k8s_cluster, gateway, "watch", "pods", *ns)
    assert _can_i(k8s_cluster, gateway, "watch", "llmdeployments.corral.dev", *ns)
    assert _can_i(k8s_cluster, gateway, "patch", "llmdeployments.corral.dev", *ns)
    assert not _can_i(k8s_cluster, gateway, "list", "endpointslices.discovery.k8s.io", *ns)
    assert not _can_i(k8s_cluster, gateway, "create", "pods", *ns)
    assert not _can_i(k8s_cluster, gateway, "get", "secrets", *ns)


def _operator_argv(cluster: Cluster, rel: Release, kubeconfig: Path, liveness_port: int) -> list[str]:
    """The chart's own operator arguments, plus what differs for a process outside the cluster."""
    (container,) = _deployment(cluster, rel, "operator")["spec"]["template"]["spec"]["containers"]
    argv = [sys.executable, "-m", "corral_cli.main", *container["args"]]
    argv += ["--kubeconfig", str(kubeconfig), "--priority", "100", "--scrape-network", "127.0.0.0/8"]
    argv += ["--liveness", f"http://127.0.0.1:{liveness_port}/healthz"]  # the last --liveness wins
    return argv


def _operator_env(cluster: Cluster, rel: Release) -> dict[str, str]:
    """The chart's operator environment, a downward-API field read from one of its (kwok) pods."""
    (container,) = _deployment(cluster, rel, "operator")["spec"]["template"]["spec"]["containers"]
    selector = f"app.kubernetes.io/instance={rel.name},app.kubernetes.io/component=operator"
    pod = cluster.get_json("pods", "-n", rel.namespace, "-l", selector)["items"][0]
    env = {}
    for var in container.get("env") or ():
        field = (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = var["value"] if "value" in var else pod["metadata"][field.split(".", 1)[1]]
    return env


def _gateway_config(cluster: Cluster, rel: Release, kubeconfig: Path, path: Path) -> Path:
    config_map = cluster.get_json("configmap", f"{rel.name}-gateway", "-n", rel.namespace)
    settings = yaml.safe_load(config_map["data"]["gateway.yaml"])
    settings["kubernetes"]["kubeconfig"] = str(kubeconfig)  # in a pod: the ServiceAccount's token
    path.write_text(yaml.safe_dump(settings))
    return path


def _example(namespace: str, port: int) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"]["engine"]["port"] = port  # a free port, so a real engine can take it on a pod IP
    return manifest


def _available(cluster: Cluster, namespace: str, name: str) -> bool:
    obj = cluster.get_json("llmd", name, "-n", namespace)
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def _running_pod_ips(cluster: Cluster, namespace: str, name: str, count: int) -> list[str] | None:
    """The IPs of the LLMDeployment's running pods once there are `count` of them."""
    pods = cluster.get_json("pods", "-n", namespace, "-l", labels.selector_string(name))["items"]
    ips = sorted(
        p["status"]["podIP"]
        for p in pods
        if p["status"].get("phase") == "Running"
        and p["status"].get("podIP")
        and not p["metadata"].get("deletionTimestamp")
    )
    return ips if len(ips) == count else None


def test_chart_operator_and_gateway_serve_the_example(
    k8s_cluster: Cluster,
    release: Release,
    k8s_namespace: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    cluster, ns = k8s_cluster, k8s_namespace
    gateway_kubeconfig = cluster.kubeconfig_for(*release.identity("gateway"))
    with chart_operator(cluster, release, tmp_path):
        # kopf names its peer after its pod (the chart's POD_ID), not user@host/time/random
        pod_id = _operator_env(cluster, release)["POD_ID"]
        cluster.wait_until(
            "the operator's peer named after its pod",
            lambda: pod_id in (cluster.get_json("clusterkopfpeering", release.name).get("status") or {}),
        )
        example, pod_ips = _reconcile_example(cluster, ns, replicas=2)
        port = example["spec"]["engine"]["port"]
        engine_argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(tiny_model_dir)]
        engine_argv += ["--served-model-name", example["spec"]["model"]["name"], "--num-threads", "1"]
        engine_argv += ["--host", pod_ips[0], "--port", str(port)]
        with ManagedProcess(engine_argv, port, name="engine", log_dir=tmp_path) as engine:
            engine.url = f"http://{pod_ips[0]}:{port}"  # the pod's address, not 127.0.0.1
            engine.wait_ready(180)
            config = _gateway_config(cluster, release, gateway_kubeconfig, tmp_path / "gateway.yaml")
            gateway_port = free_port()
            gateway_argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--config", str(config)]
            gateway_argv += ["--host", "127.0.0.1", "--port", str(gateway_port)]
            with ManagedProcess(gateway_argv, gateway_port, name="gateway", log_dir=tmp_path) as gateway:
                gateway.wait_ready(60)
                _chat_through(gateway.url, example["spec"]["model"]["name"])
                _helm_test(cluster, release, gateway.url)


def _pod_or_none(cluster: Cluster, namespace: str, name: str, phase: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        return None
    pod: dict[str, Any] = json.loads(result.stdout)
    return pod if pod.get("status", {}).get("phase") == phase else None


def _finish_pod(cluster: Cluster, pod: dict[str, Any], exit_code: int) -> None:
    """Write a terminated pod's status, as a kubelet would once its container exited."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    statuses = [
        {
            **status,
            "ready": False,
            "started": False,
            "state": {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": now,
                    "finishedAt": now,
                }
            },
        }
        for status in pod["status"].get("containerStatuses") or []
    ]
    phase = "Succeeded" if exit_code == 0 else "Failed"
    patch = {"status": {"phase": phase, "containerStatuses": statuses}}
    name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
    cluster.kubectl("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps(patch))  # fmt: skip


def _helm_test(cluster: Cluster, rel: Release, gateway_url: str) -> None:
    """`helm test`, with this process as the test pod's kubelet: kwok completes only Jobs' pods, so the
    pod's own command runs here (its arguments, with the local gateway's address after the Service's
    cluster DNS name, which nothing resolves here) and its exit code becomes the pod's phase."""
    name = f"{rel.name}-gateway-test"
    with ThreadPoolExecutor(1) as pool:
        helm = pool.submit(cluster.helm, "test", rel.name, "--namespace", rel.namespace, "--timeout=120s",
                           check=False)  # fmt: skip
        pod = cluster.wait_until(
            "the helm test pod running", lambda: _pod_or_none(cluster, rel.namespace, name, "Running"), 60
        )
        (container,) = pod["spec"]["containers"]
        argv = [sys.executable, "-m", "corral_cli.main", *container["args"], "--base-url", gateway_url]
        check = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
        _finish_pod(cluster, pod, check.returncode)
        outcome = helm.result()
    assert check.returncode == 0, check.stdout + check.stderr
    assert "check passed" in check.stderr
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    assert "Succeeded" in outcome.stdout, outcome.stdout


def test_namespaced_chart_operator_needs_only_its_roles(
    k8s_cluster: Cluster, k8s_namespace: str, tmp_path: Path
) -> None:
    """operator.namespaces: a Role, RoleBinding and KopfPeering in the served namespace only."""
    cluster, ns = k8s_cluster, k8s_namespace
    settings = [f"operator.namespaces={{{ns}}}", "gateway.enabled=false", "dashboards.enabled=false"]
    with installed(cluster, *settings, f"networkPolicy.engineNamespaces={{{ns}}}") as rel:
        kubeconfig = cluster.kubeconfig_for(*rel.identity("operator"))
        assert _can_i(cluster, kubeconfig, "patch", "deployments.apps", "-n", ns)
        assert not _can_i(cluster, kubeconfig, "list", "llmdeployments.corral.dev", "--all-namespaces")
        assert not _can_i(cluster, kubeconfig, "patch", "clusterkopfpeerings.kopf.dev")
        cluster.get_json("kopfpeering", rel.name, "-n", ns)
        with chart_operator(cluster, rel, tmp_path):
            _reconcile_example(cluster, ns, replicas=1)


def _reconcile_example(cluster: Cluster, ns: str, replicas: int) -> tuple[dict[str, Any], list[str]]:
    """Applies examples/tiny-llama.yaml in `ns` and waits for Available and its running pods' IPs."""
    example = _example(ns, free_port())
    example["spec"]["replicas"] = replicas
    name = example["metadata"]["name"]
    cluster.apply(json.dumps(example))
    cluster.wait_until("the example LLMDeployment Available", lambda: _available(cluster, ns, name), 120)
    for kind in ("deployment", "service", "poddisruptionbudget"):
        child = cluster.get_json(kind, name, "-n", ns)
        assert child["metadata"]["ownerReferences"][0]["kind"] == "LLMDeployment"
    pod_ips = cluster.wait_until("running engine pods", lambda: _running_pod_ips(cluster, ns, name, replicas))
    assert all(ipaddress.ip_address(ip) in LOOPBACK for ip in pod_ips), pod_ips
    return example, pod_ips


def _chat_through(gateway_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    # Discovery is asynchronous: the model is listed once the gateway's pod watch has caught up.
    deadline = time.monotonic() + 30
    served: list[str] = []
    while model not in served and time.monotonic() < deadline:
        served = [m.id for m in client.models.list().data]
        time.sleep(0.2)
    assert model in served, served
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    client.close()
