"""Kube's writes against an API stand-in on 127.0.0.1: who the API server is told made them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from corral_operator.kube import Kube
from kubernetes import client


@pytest.fixture
def patches() -> Iterator[tuple[list[tuple[str, dict[str, list[str]]]], Kube]]:
    seen: list[tuple[str, dict[str, list[str]]]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return

        def do_PATCH(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            url = urlsplit(self.path)
            seen.append((url.path, parse_qs(url.query)))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    try:
        yield seen, Kube(client.ApiClient(config), timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_status_and_scale_writes_name_the_operator_as_field_manager(
    patches: tuple[list[tuple[str, dict[str, list[str]]]], Kube],
) -> None:
    """Not the client library's default (OpenAPI-Generator): `kubectl apply --server-side` of a
    manifest that sets spec.replicas then says it conflicts with corral-operator."""
    seen, kube = patches
    kube.patch_replicas("ml", "tiny", 3)
    kube.patch_status("ml", "tiny", {"replicas": 3}, resource_version="7")
    path = "/apis/corral.dev/v1alpha1/namespaces/ml/llmdeployments/tiny"
    assert seen == [
        (f"{path}/scale", {"fieldManager": ["corral-operator"]}),
        (f"{path}/status", {"fieldManager": ["corral-operator"]}),
    ]
