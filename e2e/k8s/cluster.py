"""A real Kubernetes control plane on 127.0.0.1 for e2e tests: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (fake Nodes whose Pods report Running).

Start it with `with Cluster(ensure_toolchain(), work_dir) as cluster:`; everything it starts is
stopped on exit, also when start-up fails half-way.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

from e2e.k8s import manifests
from e2e.k8s.manifests import DEFAULT_NODES, FakeNode, StaticToken
from e2e.k8s.pki import Pki, create_pki
from e2e.k8s.processes import ManagedProcess
from e2e.k8s.toolchain import Toolchain
from e2e.procs import free_port

logger = logging.getLogger(__name__)

ADMIN_USER = "corral-e2e-admin"
OPERATOR_NAMESPACE = "corral-system"
OPERATOR_SERVICE_ACCOUNT = "corral-operator"
# The identity the operator's ServiceAccount has; RBAC bound to that ServiceAccount applies to it.
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SERVICE_ACCOUNT}"
OPERATOR_GROUPS = ("system:serviceaccounts", f"system:serviceaccounts:{OPERATOR_NAMESPACE}")

# Controllers the tests rely on; everything else (node lifecycle, IPAM, cloud, ...) stays off.
CONTROLLERS = (
    "garbage-collector-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "job-controller",
    "endpointslice-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "disruption-controller",  # PodDisruptionBudget status (disruptionsAllowed), as `kubectl drain` reads it
)

_READY_TIMEOUT_S = 120.0
_POLL_INTERVAL_S = 0.25

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The control plane failed to start or a kubectl call failed."""


class Cluster:
    def __init__(
        self, toolchain: Toolchain, work_dir: Path, nodes: Sequence[FakeNode] = DEFAULT_NODES
    ) -> None:
        self.toolchain = toolchain
        self.work_dir = work_dir
        self.nodes = tuple(nodes)
        self.log_dir = work_dir / "logs"
        self.port = free_port()
        self.server_url = f"https://127.0.0.1:{self.port}"
        self.admin_kubeconfig = work_dir / "admin.kubeconfig"
        self.operator_kubeconfig = work_dir / "operator.kubeconfig"
        self._tokens = {
            name: StaticToken(secrets.token_hex(16), user, f"uid-{name}", groups)
            for name, user, groups in (
                ("admin", ADMIN_USER, ("system:masters",)),
                ("operator", OPERATOR_USER, OPERATOR_GROUPS),
                ("controller-manager", "system:kube-controller-manager", ()),
                ("scheduler", "system:kube-scheduler", ()),
                ("kwok", "corral-e2e-kwok", ("system:masters",)),
            )
        }
        self._processes: list[ManagedProcess] = []
        self._pki: Pki | None = None
        self._env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        started = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._pki = create_pki(self.work_dir / "pki")
        (self.work_dir / "tokens.csv").write_text(manifests.token_file_text(self._tokens.values()))
        for name in self._tokens:
            self._write_token_kubeconfig(name, self._kubeconfig_path(name))
        self.operator_kubeconfig = self._kubeconfig_path("operator")
        self.admin_kubeconfig = self._kubeconfig_path("admin")

        etcd_url = self._start_etcd()
        self._start_apiserver(etcd_url)
        self._wait("kube-apiserver /readyz", self._is_apiserver_ready)
        self._start_controller_manager()
        self._start_scheduler()
        self.apply(yaml.safe_dump_all([manifests.node_manifest(n) for n in self.nodes]))
        self._start_kwok()
        self._wait("fake nodes Ready", self._are_nodes_ready)
        # The ServiceAccount admission plugin refuses Pods until the namespace's default account exists.
        self._wait("default ServiceAccount", lambda: self._exists("serviceaccount", "default", "default"))
        logger.info(
            "Kubernetes control plane ready at %s in %.1fs", self.server_url, time.monotonic() - started
        )

    def stop(self) -> None:
        for process in reversed(self._processes):
            try:
                process.stop()
            except OSError:
                logger.exception("could not stop %s", process.name)
        self._processes.clear()

    # -- helpers for tests -----------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        stdin: str | None = None,
        check: bool = True,
        timeout_s: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl against this cluster (as admin unless another kubeconfig is given)."""
        argv = [
            str(self.toolchain.binary("kubectl")),
            f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
            f"--cache-dir={self.work_dir / 'kubectl-cache'}",
            *args,
        ]
        result = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, env=self._env, timeout=timeout_s, check=False
        )
        if check and result.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def helm(
        self, *args: str, kubeconfig: Path | None = None, check: bool = True, timeout_s: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs helm against this cluster; its cache, config and data stay in the cluster's work dir."""
        helm_home = self.work_dir / "helm"
        env = {
            **self._env,
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }
        argv = [
            str(self.toolchain.binary("helm")),
            f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
            *args,
        ]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        if check and result.returncode != 0:
            raise ClusterError(f"helm {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def get_json(self, *args: str, kubeconfig: Path | None = None) -> dict[str, Any]:
        """`kubectl get ... -o json`, parsed."""
        parsed: dict[str, Any] = json.loads(
            self.kubectl("get", *args, "-o", "json", kubeconfig=kubeconfig).stdout
        )
        return parsed

    def apply(
        self, manifest: str | Path, *, namespace: str | None = None, kubeconfig: Path | None = None
    ) -> None:
        """Applies YAML given as text or as a file/directory path (e.g. the operator's RBAC)."""
        target = ["-n", namespace] if namespace else []
        if isinstance(manifest, Path):
            self.kubectl("apply", *target, "-f", str(manifest), kubeconfig=kubeconfig)
        else:
            self.kubectl("apply", *target, "-f", "-", stdin=manifest, kubeconfig=kubeconfig)

    def ensure_namespace(self, name: str) -> None:
        self.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))

    def apply_operator_rbac(self, manifest: str | Path) -> Path:
        """Applies the operator's RBAC (e.g. the chart's rendered Role/ClusterRole and bindings to the
        corral-operator ServiceAccount) and returns the kubeconfig that acts as that ServiceAccount."""
        self.ensure_namespace(OPERATOR_NAMESPACE)
        self.apply(manifest)
        return self.operator_kubeconfig

    def kubeconfig_for(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig for any user and groups (a client certificate from the cluster's CA).

        The user gets exactly what RBAC grants it, which makes it the way to test a Role.
        """
        cert, key = self.pki.client_cert(user, tuple(groups))
        path = self.work_dir / f"user-{cert.stem.removeprefix('client-')}.kubeconfig"
        config = manifests.kubeconfig(
            self.server_url, str(self.pki.ca_cert), user, client_cert_file=str(cert), client_key_file=str(key)
        )
        path.write_text(yaml.safe_dump(config))
        return path

    def endpoint_slices(self, namespace: str, service: str | None = None) -> list[dict[str, Any]]:
        selector = ["-l", f"kubernetes.io/service-name={service}"] if service else []
        items: list[dict[str, Any]] = self.get_json("endpointslices", "-n", namespace, *selector)["items"]
        return items

    def assert_endpoint_slices_loopback(
        self, namespace: str, service: str | None = None
    ) -> list[dict[str, Any]]:
        """Guard for the machines' network rule: every EndpointSlice address must be in 127.0.0.0/8."""
        items = self.endpoint_slices(namespace, service)
        bad = manifests.non_loopback_addresses(items)
        if bad:
            raise AssertionError(
                f"EndpointSlices in {namespace} hold non-loopback addresses {bad}; never dial them"
            )
        return items

    def wait_until(self, what: str, probe: Callable[[], T | None], timeout_s: float = 60.0) -> T:
        """Polls probe until it returns something truthy, failing with the component logs otherwise."""
        return self._wait(what, probe, timeout_s)

    def component_logs(self) -> dict[str, Path]:
        return {p.name: p.log_path for p in self._processes}

    @property
    def pki(self) -> Pki:
        if self._pki is None:
            raise ClusterError("the cluster is not started")
        return self._pki

    # -- internals -------------------------------------------------------------------------------

    def _kubeconfig_path(self, name: str) -> Path:
        return self.work_dir / f"{name}.kubeconfig"

    def _write_token_kubeconfig(self, name: str, path: Path) -> None:
        token = self._tokens[name]
        config = manifests.kubeconfig(self.server_url, str(self.pki.ca_cert), token.user, token=token.token)
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)

    def _start(self, name: str, *args: str | Path) -> ManagedProcess:
        process = ManagedProcess(name, [self.toolchain.binary(name), *args], self.log_dir, self._env)
        self._processes.append(process)
        return process

    def _start_etcd(self) -> str:
        client_url = f"http://127.0.0.1:{free_port()}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        self._start(
            "etcd",
            "--name=corral-e2e",
            f"--data-dir={self.work_dir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=corral-e2e={peer_url}",
            # Throwaway data: skipping fsync makes the API server several times faster on shared disks.
            "--unsafe-no-fsync",
            "--log-level=warn",
        )
        self._wait("etcd /health", lambda: _http_ok(f"{client_url}/health"))
        return client_url

    def _start_apiserver(self, etcd_url: str) -> None:
        pki = self.pki
        self._start(
            "kube-apiserver",
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.work_dir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={self.work_dir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={self.server_url}",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={manifests.SERVICE_CIDR}",
            # The `kubernetes` Service's endpoints would be 127.0.0.1, which Endpoints validation refuses.
            "--endpoint-reconciler-type=none",
            # It taints new Nodes not-ready until the node-lifecycle controller, which is not run here
            # (kwok's heartbeats would race its grace periods on busy machines), clears the taint.
            "--disable-admission-plugins=TaintNodesByCondition",
            "--profiling=false",
        )

    def _start_controller_manager(self) -> None:
        self._start(
            "kube-controller-manager",
            f"--kubeconfig={self._kubeconfig_path('controller-manager')}",
            f"--controllers={','.join(CONTROLLERS)}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.pki.service_account_key}",
            f"--root-ca-file={self.pki.ca_cert}",
            "--leader-elect=false",
            "--secure-port=0",
            "--profiling=false",
        )

    def _start_scheduler(self) -> None:
        self._start(
            "kube-scheduler",
            f"--kubeconfig={self._kubeconfig_path('scheduler')}",
            "--leader-elect=false",
            "--secure-port=0",
            "--profiling=false",
        )

    def _start_kwok(self) -> None:
        self._start(
            "kwok",
            f"--kubeconfig={self._kubeconfig_path('kwok')}",
            f"--config={self.toolchain.kwok_stages}",
            f"--manage-nodes-with-annotation-selector={manifests.KWOK_NODE_ANNOTATION}=fake",
            f"--cidr={manifests.POD_CIDR}",
            f"--node-ip={manifests.NODE_IP}",
        )

    def _is_apiserver_ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        token = self._tokens["admin"].token
        return _http_ok(f"{self.server_url}/readyz", context=context, token=token)

    def _are_nodes_ready(self) -> bool:
        nodes = self.get_json("nodes")["items"]
        ready = {
            n["metadata"]["name"]
            for n in nodes
            for c in n.get("status", {}).get("conditions", [])
            if c["type"] == "Ready" and c["status"] == "True"
        }
        return ready >= {n.name for n in self.nodes}

    def _exists(self, kind: str, name: str, namespace: str) -> bool:
        return self.kubectl("get", kind, name, "-n", namespace, check=False).returncode == 0

    def _wait(self, what: str, probe: Callable[[], T | None], timeout_s: float = _READY_TIMEOUT_S) -> T:
        deadline = time.monotonic() + timeout_s
        while True:
            for process in self._processes:
                if not process.is_running():
                    raise ClusterError(f"while waiting for {what}: {process.describe_exit()}")
            result = probe()
            if result:
                return result
            if time.monotonic() > deadline:
                logs = "\n\n".join(f"== {p.name}\n{p.log_tail(15)}" for p in self._processes)
                raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{logs}")
            time.sleep(_POLL_INTERVAL_S)


def _http_ok(url: str, *, context: ssl.SSLContext | None = None, token: str | None = None) -> bool:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    # No proxy handler: a proxy from the environment must never see control-plane traffic.
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    try:
        with opener.open(request, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
