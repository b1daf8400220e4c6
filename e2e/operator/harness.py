"""Helpers for the operator e2e tests: `corral operator` as a real subprocess running with the
operator identity's RBAC, LLMDeployment manifests, and fake engine /metrics servers bound on the
fake cluster's loopback pod IPs (so the operator's real scraper reads them)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from corral_operator import labels

from e2e.k8s.cluster import Cluster
from e2e.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


class OperatorProcess:
    """`corral operator` with the operator's kubeconfig; only pod IPs in 127.0.0.0/8 are scraped."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        *,
        priority: int | None = 100,  # None: the operator's default (its start time)
        resync_s: float = 2.0,
        namespaces: list[str] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespaces = namespaces or []
        self.log_path = log_path
        self.priority = priority
        self.resync_s = resync_s
        self.liveness_port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        argv = [
            sys.executable, "-m", "corral_cli.main", "operator",
            "--kubeconfig", str(self.kubeconfig),
            *([a for ns in self.namespaces for a in ("--namespace", ns)] or ["--all-namespaces"]),
            "--peering", "corral",
            *(["--priority", str(self.priority)] if self.priority is not None else []),
            "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--resync-seconds", str(self.resync_s),
            "--scrape-network", "127.0.0.0/8",
        ]  # fmt: skip
        env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def is_alive(self) -> bool:
        if self._process is None or self._process.poll() is not None:
            return False
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def wait_alive(self, timeout_s: float = 60.0) -> OperatorProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise AssertionError(f"operator exited ({self._process.returncode}):\n{self.log()}")
            if self.is_alive():
                return self
            time.sleep(0.3)
        raise AssertionError(f"operator not alive after {timeout_s}s:\n{self.log()}")

    def stop(self) -> None:
        """Graceful: kopf removes itself from the peering object on the way out."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def llmdeployment(
    name: str,
    namespace: str,
    *,
    replicas: int = 2,
    port: int = 8000,
    image: str = "corral-engine:e2e",
    max_num_seqs: int = 8,
    autoscaling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": name, "source": {"hostPath": {"path": "/var/lib/corral/models/tiny"}}},
        "engine": {"kind": "corral", "image": image, "port": port, "args": {"maxNumSeqs": max_num_seqs}},
        "replicas": replicas,
        "resources": {"cpu": "100m", "memory": "128Mi"},
    }
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {
        "apiVersion": "corral.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


# The Prometheus Operator's ServiceMonitor kind, schema left open: enough for the operator to find it
# (API discovery) and apply one.
SERVICE_MONITOR_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: servicemonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: ServiceMonitor, plural: servicemonitors, singular: servicemonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"""


def install_service_monitor_crd(cluster: Cluster) -> None:
    cluster.apply(SERVICE_MONITOR_CRD)
    cluster.kubectl("wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com")


class WatchLLMD:
    """`kubectl get llmd NAME -w -o json` in the background: every version of the object the API
    server had while the watch ran (a poll would miss a state that lasts a second)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, out_path: Path) -> None:
        self._argv = [
            str(cluster.toolchain.binary("kubectl")),
            f"--kubeconfig={cluster.admin_kubeconfig}",
            "get", "llmd", name, "-n", namespace, "-w", "-o", "json",
        ]  # fmt: skip
        self._out_path = out_path
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> WatchLLMD:
        env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        with self._out_path.open("wb") as out:
            self._process = subprocess.Popen(self._argv, stdout=out, stderr=subprocess.DEVNULL, env=env)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)

    def versions(self) -> list[dict[str, Any]]:
        """The objects seen so far, in order (kubectl writes one JSON document per change)."""
        text, decoder, out = self._out_path.read_text(), json.JSONDecoder(), []
        pos = 0
        while (pos := _skip_space(text, pos)) < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                break  # a document still being written
            out.append(obj)
        return out


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def events_of(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.name={name}"
    return list(cluster.get_json("events", "-n", namespace, "--field-selector", selector)["items"])


def get_llmd(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", "llmd", name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        return None
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def is_available(obj: dict[str, Any] | None) -> bool:
    return condition(obj, "Available").get("status") == "True"


def running_pods(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", labels.selector_string(name))["items"]
    return [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


class FakeEngineMetrics:
    """Prometheus /metrics (and /health) served on each pod's loopback IP and the engine port."""

    def __init__(self, port: int, waiting: float = 0.0, running: float = 0.0, kv_usage: float = 0.0) -> None:
        self.port = port
        self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
        self._servers: dict[str, ThreadingHTTPServer] = {}

    def text(self) -> bytes:
        return (
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_usage}\n'
        ).encode()

    def serve_on(self, ip: str) -> None:
        if ip in self._servers:
            return
        if ipaddress.ip_address(ip) not in LOOPBACK:
            raise AssertionError(f"pod IP {ip} is not loopback; refusing to bind or dial it")
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = fake.text() if self.path == "/metrics" else b"ok"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer((ip, self.port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._servers[ip] = server

    def close(self) -> None:
        for server in self._servers.values():
            server.shutdown()
            server.server_close()
        self._servers.clear()


@contextlib.contextmanager
def fake_metrics(port: int, **values: float) -> Iterator[FakeEngineMetrics]:
    fake = FakeEngineMetrics(port, **values)
    try:
        yield fake
    finally:
        fake.close()
