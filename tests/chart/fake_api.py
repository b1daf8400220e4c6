"""A stand-in for the Kubernetes API holding a few objects, for templates that `lookup` the cluster.

It answers only what `helm template --dry-run=server` reads: the version, discovery of the kinds the
gateway's templates render, and GETs of single objects (the chart's lookups and Helm's ownership
check); everything else is 404. It serves 127.0.0.1 on a free port from a thread: no cluster runs.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

# group/version -> (resource, kind, namespaced) for each kind the gateway's templates render.
KINDS: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("configmaps", "ConfigMap", True),
        ("services", "Service", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("secrets", "Secret", True),
    ],
    "apps/v1": [("deployments", "Deployment", True)],
    "autoscaling/v2": [("horizontalpodautoscalers", "HorizontalPodAutoscaler", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "rbac.authorization.k8s.io/v1": [
        ("clusterroles", "ClusterRole", False),
        ("clusterrolebindings", "ClusterRoleBinding", False),
    ],
}
NOT_FOUND = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}


def object_path(obj: dict[str, Any]) -> str:
    group_version, meta = obj["apiVersion"], obj["metadata"]
    (resource,) = [r for r, kind, _ in KINDS[group_version] if kind == obj["kind"]]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    namespace = f"/namespaces/{meta['namespace']}" if "namespace" in meta else ""
    return f"{prefix}{namespace}/{resource}/{meta['name']}"


def _discovery(path: str) -> dict[str, Any] | None:
    if path == "/version":
        return {"major": "1", "minor": "36", "gitVersion": "v1.36.0"}
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"]}
    if path == "/apis":
        groups = []
        for group_version in KINDS:
            if "/" in group_version:
                group, version = group_version.split("/")
                entry = {"groupVersion": group_version, "version": version}
                groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    group_version = path.removeprefix("/api/") if path.startswith("/api/") else path.removeprefix("/apis/")
    if group_version not in KINDS:
        return None
    resources = [
        {"name": r, "singularName": kind.lower(), "namespaced": ns, "kind": kind, "verbs": ["get", "list"]}
        for r, kind, ns in KINDS[group_version]
    ]
    return {"kind": "APIResourceList", "groupVersion": group_version, "resources": resources}


class FakeApi:
    """`with FakeApi(objects) as api:` serves them; api.kubeconfig(dir) points helm at it."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = {object_path(obj): obj for obj in objects}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        objects = self.objects

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                body = _discovery(path) or objects.get(path)
                self.send_response(404 if body is None else 200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body or NOT_FOUND).encode())

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: pytest shows helm's stderr when a test fails."""

        return Handler

    def kubeconfig(self, directory: Path) -> Path:
        host, port = self.server.server_address[:2]
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://{host}:{port}"}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)  # helm warns about a group- or world-readable kubeconfig
        return path

    def __enter__(self) -> FakeApi:
        self.thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
