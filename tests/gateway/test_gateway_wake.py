"""Scale from zero: the owner lookup, the rate-limited wake patch, and requests waiting for a replica
(a model's, and a LoRA adapter's its LLMDeployment declares, through a gateway watching an API stand-in)."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
from corral_engine import wire
from corral_gateway.admission import Ask
from corral_gateway.app import create_app
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import Discovery, discover
from corral_gateway.k8s_names import Served
from corral_gateway.k8s_wake import Waker, wake_patch
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.registry import Replica
from corral_gateway.settings import GatewaySettings

from tests.gateway import fake_kube_api
from tests.gateway.conftest import FakeEngine, serve
from tests.gateway.test_gateway_proxy import eventually


def test_owners_from_operator_labels() -> None:
    objs = [
        {
            "metadata": {
                "namespace": "ns",
                "labels": {"corral.dev/model": "m", "app.kubernetes.io/instance": "llmd"},
            }
        },
        {"metadata": {"namespace": "ns", "labels": {"corral.dev/model": "x"}}},  # no owner label
    ]
    found = discover(objs, is_pods=True, model_label="corral.dev/model", port_name="http")
    assert found.owners == {"m": ("ns", "llmd")}


def test_wake_patch_is_an_rfc3339_annotation() -> None:
    assert wake_patch(0.0) == {"metadata": {"annotations": {wire.WAKE_ANNOTATION: "1970-01-01T00:00:00Z"}}}


def test_waker_patches_at_most_once_per_interval() -> None:
    calls: list[tuple[str, str, dict[str, Any]]] = []
    done = threading.Event()

    def patch(namespace: str, name: str, body: dict[str, Any]) -> None:
        calls.append((namespace, name, body))
        done.set()

    now = [100.0]
    waker = Waker(None, min_interval_s=10.0, clock=lambda: now[0], patch=patch)
    assert not waker.wake("m")  # owner unknown
    waker.set_owners({"m": ("ns", "llmd")})
    assert waker.wake("m") and done.wait(5)
    assert waker.wake("m")  # still waking, but no second patch yet
    now[0] = 111.0
    done.clear()
    assert waker.wake("m") and done.wait(5)
    assert [(c[0], c[1]) for c in calls] == [("ns", "llmd"), ("ns", "llmd")]


def test_a_model_nothing_wakes_gets_the_normal_queue_deadline() -> None:
    settings = GatewaySettings(kubernetes={"enabled": True, "wake_timeout_s": 300.0}, queue_timeout_s=30)
    fleet = Fleet(settings, GatewayMetrics())
    woken: list[str] = []
    fleet.waker = Waker(None, patch=lambda ns, name, body: woken.append(name))
    off = Served("ml", "off", "m", can_wake=False)
    fleet.apply_discovery(
        discover([], is_pods=True, model_label="corral.dev/model", port_name="http", served=[off])
    )
    assert fleet.wake_timeout_s("m") is None  # the 30 s queue deadline, not 300 s for a wake-up
    assert woken == []


async def test_request_for_a_model_at_zero_waits_for_a_replica() -> None:
    settings = GatewaySettings(kubernetes={"enabled": True, "wake_timeout_s": 5.0}, queue_timeout_s=0.05)
    fleet = Fleet(settings, GatewayMetrics())
    woken: list[str] = []
    fleet.waker = Waker(None, patch=lambda ns, name, body: woken.append(name))
    owners = {"m": ("ns", "llmd")}
    fleet.apply_discovery(Discovery({"m": []}, owners))
    assert fleet.waker.owners == owners
    timeout_s = fleet.wake_timeout_s("m")
    assert timeout_s == 5.0

    async def lease() -> Replica:
        async with fleet.lease(Ask("m", timeout_s=timeout_s)) as replica:
            return replica

    waiter = asyncio.create_task(lease())
    await asyncio.sleep(0.2)  # longer than the normal queue deadline
    assert not waiter.done()
    fleet.apply_discovery(Discovery({"m": ["http://127.0.0.1:9"]}, owners))
    replica = await asyncio.wait_for(waiter, 2)
    assert isinstance(replica, Replica) and replica.url == "http://127.0.0.1:9"
    assert fleet.wake_timeout_s("m") is None  # a replica is in rotation now


def _llmd_with_adapter(namespace: str, name: str) -> dict[str, Any]:
    spec = {
        "model": {"name": "m"},
        "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}],
        "autoscaling": {"minReplicas": 0},
    }
    return {"kind": "LLMDeployment", "metadata": {"namespace": namespace, "name": name}, "spec": spec}


def _ready_pod(namespace: str, owner: str, port: int) -> dict[str, Any]:
    labels = {wire.MANAGED_BY_LABEL: wire.MANAGED_BY_VALUE, wire.INSTANCE_LABEL: owner}
    return {
        "metadata": {"namespace": namespace, "name": f"{owner}-0", "labels": labels},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


async def test_an_adapter_request_at_zero_replicas_wakes_its_deployment_and_is_served(tmp_path: Path) -> None:
    """An adapter its LLMDeployment declares, at zero replicas: /v1/models lists it under its
    deployment's model, a request for it (bare or NAMESPACE/NAME) sets the wake annotation and
    waits, and the first replica to come up serves it, sent under the adapter's own name; once
    unloaded there, it is a 404."""
    engine = FakeEngine(name="woken", adapters={"sql": "/adapters/sql"})
    api = fake_kube_api.FakeKubeApi()
    api.items[("ml", "llmdeployments")] = [_llmd_with_adapter("ml", "llama")]
    async with AsyncExitStack() as stack:
        engine_url, _ = await stack.enter_async_context(serve(engine.app()))
        kubeconfig = stack.enter_context(fake_kube_api.serve(api, tmp_path))
        k8s = {"enabled": True, "source": "pods", "namespaces": ["ml"], "kubeconfig": kubeconfig}
        settings = GatewaySettings(
            kubernetes={**k8s, "wake_timeout_s": 120.0}, poll_interval_s=0.02, queue_timeout_s=2.0
        )
        gateway_url, _ = await stack.enter_async_context(serve(create_app(settings)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=gateway_url, timeout=120))

        async def listed() -> dict[str, Any]:
            return {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}

        async def is_discovered() -> bool:
            return "sql" in await listed()

        # A guard against a hang: the watcher imports the kubernetes client first (13 s seen on a
        # loaded 2-core machine).
        await eventually(is_discovered, timeout_s=60)
        card = {"object": "model", "created": 0, "owned_by": "corral"}
        assert await listed() == {"m": {"id": "m", **card}, "sql": {"id": "sql", **card, "parent": "m"}}
        asked = [
            asyncio.create_task(client.post("/v1/completions", json={"model": name, "prompt": "x"}))
            for name in ("sql", "ml/sql")
        ]

        async def is_woken() -> bool:
            return bool(api.patches)

        await eventually(is_woken, timeout_s=60)
        namespace, plural, name, body = api.patches[0]
        assert (namespace, plural, name) == ("ml", "llmdeployments", "llama")
        assert wire.WAKE_ANNOTATION in body["metadata"]["annotations"]
        assert not any(task.done() for task in asked) and engine.bodies == []
        api.push("ml", "pods", "ADDED", _ready_pod("ml", "llama", int(engine_url.rsplit(":", 1)[1])))
        async with asyncio.timeout(60):  # a guard against a hang
            answers = await asyncio.gather(*asked)
        assert [(a.status_code, a.json().get("served_by")) for a in answers] == [(200, "woken")] * 2
        assert [json.loads(raw)["model"] for raw in engine.bodies] == ["sql", "sql"]
        # Unloaded at run time: once the replica says so, its requests get 404 at once, as an
        # adapter nobody declares does, instead of waiting in the model's queue for nothing.
        engine.adapters = {}

        async def is_unloaded() -> bool:
            replica = (await client.get("/corral/replicas")).json()["models"]["m"][0]
            return replica["served_names"] == ["m"]  # said, and no adapter among them

        await eventually(is_unloaded, timeout_s=30)
        gone = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
