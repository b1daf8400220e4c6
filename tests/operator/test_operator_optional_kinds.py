"""Whether the cluster serves ServiceMonitors and ScaledObjects, learnt from API discovery (Kube.serves,
Context.installed_crds), and whether its LLMDeployment CRD is older than the operator's (its OpenAPI
v3 document), against an API stand-in on 127.0.0.1 that refuses CRD reads, as a namespaced
operator's Roles do."""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from corral_operator.context import CRD_CACHE_S, Context
from corral_operator.crd import expected_schema
from corral_operator.kube import Kube
from kubernetes import client

SERVICE_MONITORS = "servicemonitors.monitoring.coreos.com"
SCALED_OBJECTS = "scaledobjects.keda.sh"


def resource_list(group_version: str, *plurals: str) -> tuple[int, dict[str, Any]]:
    resources = [{"name": p, "namespaced": True, "kind": p.title(), "verbs": ["get"]} for p in plurals]
    return 200, {"kind": "APIResourceList", "groupVersion": group_version, "resources": resources}


FORBIDDEN = (403, {"kind": "Status", "code": 403, "reason": "Forbidden", "message": "forbidden"})
NOT_FOUND = (404, {"kind": "Status", "code": 404, "reason": "NotFound"})


class Api:
    """path -> (status, JSON body); anything else is 403 (a Role grants nothing cluster-scoped)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, Any]]] = {}
        self.paths: list[str] = []


@pytest.fixture
def api() -> Iterator[tuple[Api, Kube]]:
    state = Api()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            state.paths.append(self.path)
            status, body = state.routes.get(self.path, FORBIDDEN)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    try:
        yield state, Kube(client.ApiClient(config), timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_namespaced_operator_finds_installed_kinds_without_reading_crds(api: tuple[Api, Kube]) -> None:
    state, kube = api
    state.routes["/apis/monitoring.coreos.com/v1"] = resource_list(
        "monitoring.coreos.com/v1", "servicemonitors", "podmonitors"
    )
    state.routes["/apis/keda.sh/v1alpha1"] = resource_list("keda.sh/v1alpha1", "scaledobjects")
    ctx = Context(kube=kube)
    assert ctx.installed_crds(now_s=0) == {SERVICE_MONITORS, SCALED_OBJECTS}
    assert ctx.refused_crds() == frozenset()
    assert not [p for p in state.paths if "customresourcedefinitions" in p]


def test_a_group_version_not_served_or_without_the_kind_is_absent(api: tuple[Api, Kube]) -> None:
    state, kube = api
    state.routes["/apis/monitoring.coreos.com/v1"] = resource_list("monitoring.coreos.com/v1", "podmonitors")
    state.routes["/apis/keda.sh/v1alpha1"] = NOT_FOUND
    ctx = Context(kube=kube)
    assert ctx.installed_crds(now_s=0) == frozenset()
    assert ctx.refused_crds() == frozenset()


def test_refused_discovery_is_a_permission_problem_not_an_absent_kind(
    api: tuple[Api, Kube], caplog: pytest.LogCaptureFixture
) -> None:
    state, kube = api
    state.routes["/apis/monitoring.coreos.com/v1"] = resource_list(
        "monitoring.coreos.com/v1", "servicemonitors"
    )
    state.routes[OPENAPI] = NOT_FOUND  # no schema published: nothing else to warn about
    ctx = Context(kube=kube)  # /apis/keda.sh/v1alpha1 answers 403
    with caplog.at_level(logging.WARNING, logger="corral_operator.context"):
        assert ctx.installed_crds(now_s=0) == {SERVICE_MONITORS}
        assert ctx.refused_crds() == {SCALED_OBJECTS}
        ctx.installed_crds(now_s=1000)  # looked up again, still refused: warned once
    assert [r.getMessage() for r in caplog.records] == [
        "not allowed to read API discovery for ScaledObject: forbidden"
    ]


OPENAPI = "/openapi/v3/apis/corral.dev/v1alpha1"


def openapi_document(schema: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    gvk = [{"group": "corral.dev", "version": "v1alpha1", "kind": "LLMDeployment"}]
    other = {"type": "object", "x-kubernetes-group-version-kind": [{**gvk[0], "kind": "LLMDeploymentList"}]}
    schemas = {
        "dev.corral.v1alpha1.LLMDeploymentList": other,
        "dev.corral.v1alpha1.LLMDeployment": {**schema, "x-kubernetes-group-version-kind": gvk},
    }
    return 200, {"openapi": "3.0.0", "components": {"schemas": schemas}}


def test_an_older_llmdeployment_crd_is_an_error_once_until_it_is_upgraded(
    api: tuple[Api, Kube], caplog: pytest.LogCaptureFixture
) -> None:
    state, kube = api
    older = copy.deepcopy(expected_schema())
    del older["properties"]["status"]["properties"]["rolledOutRevision"]
    state.routes[OPENAPI] = openapi_document(older)
    state.routes["/apis/monitoring.coreos.com/v1"] = state.routes["/apis/keda.sh/v1alpha1"] = NOT_FOUND
    ctx = Context(kube=kube)
    with caplog.at_level(logging.INFO, logger="corral_operator.context"):
        assert "lacks status.rolledOutRevision" in (ctx.stale_crd(now_s=0) or "")
        assert ctx.pruned_status_fields(now_s=0) == {"rolledOutRevision"}
        ctx.stale_crd(now_s=CRD_CACHE_S + 1)  # looked up again, still stale: said once
        state.routes[OPENAPI] = openapi_document(expected_schema())
        assert ctx.stale_crd(now_s=2 * CRD_CACHE_S + 2) is None
        assert ctx.pruned_status_fields(now_s=2 * CRD_CACHE_S + 2) == frozenset()
    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in logged] == ["ERROR", "INFO"]
    assert "kubectl apply --server-side -f charts/corral/crds/" in logged[0][1]


def test_an_unreadable_schema_is_not_a_stale_crd(
    api: tuple[Api, Kube], caplog: pytest.LogCaptureFixture
) -> None:
    state, kube = api  # /openapi/v3/... answers 403, then 404 (a server that publishes none)
    ctx = Context(kube=kube)
    with caplog.at_level(logging.WARNING, logger="corral_operator.context"):
        assert ctx.stale_crd(now_s=0) is None
        assert ctx.stale_crd(now_s=CRD_CACHE_S + 1) is None  # refused again: said once
        state.routes[OPENAPI] = NOT_FOUND
        assert ctx.stale_crd(now_s=2 * CRD_CACHE_S + 2) is None
    refused = [r.getMessage() for r in caplog.records if "/openapi/v3" in r.getMessage()]
    assert len(refused) == 1 and "a stale CRD cannot be detected" in refused[0]
