"""LoRA adapter requests through a running gateway in front of fake replicas that list adapters (as
vLLM's `/v1/models` does, `parent` naming the base model) and report `vllm:lora_requests_info`."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from corral_gateway import replica_poller

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import eventually, fleet, replicas

LORA_INFO = (
    "# TYPE vllm:lora_requests_info gauge\n"
    'vllm:lora_requests_info{{max_lora="2",waiting_lora_adapters="",running_lora_adapters="{}"}} 1.7e+09\n'
)


@pytest.fixture(autouse=True)
def _quick_adapter_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_poller, "_ADAPTERS_CHECK_INTERVAL_S", 0.05)


async def test_an_adapter_request_goes_to_a_replica_listing_it_with_its_body_unchanged() -> None:
    with_sql = FakeEngine(name="with-sql", adapters={"sql": "/adapters/sql"})
    without = FakeEngine(name="without")
    async with fleet([with_sql, without]) as (client, _):

        async def is_listed() -> bool:
            return "sql" in [m["id"] for m in (await client.get("/v1/models")).json()["data"]]

        await eventually(is_listed)
        raw = b'{"model": "sql",  "prompt": "select", "max_tokens": 3}'
        for _ in range(4):
            response = await client.post(
                "/v1/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert response.status_code == 200 and response.json()["served_by"] == "with-sql"
        assert with_sql.bodies == [raw] * 4 and without.bodies == []
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        card = {"object": "model", "created": 1700000000, "owned_by": "fake", "max_model_len": 4096}
        assert listed == {
            "m": {"id": "m", **card},
            "sql": {"id": "sql", **card, "root": "/adapters/sql", "parent": "m"},
        }
        assert (await client.get("/v1/models/sql")).json() == listed["sql"]
        unknown = await client.post("/v1/completions", json={"model": "chat", "prompt": "x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_adapter_routes_total{affinity="free_slot",model="m"} 4.0' in metrics
        chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        streamed = await client.post("/v1/chat/completions", json=chat)
        assert streamed.status_code == 200 and '"served_by": "with-sql"' in streamed.text
        # A failing replica is not retried where the adapter is not: the engine's own error.
        with_sql.mode = "error500"
        failed = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert failed.status_code == 500 and without.bodies == []


async def test_adapters_loaded_and_unloaded_at_runtime_come_and_go() -> None:
    engine = FakeEngine(adapters={"sql": "/adapters/sql"})
    async with fleet([engine]) as (client, _):

        async def status(model: str) -> int:
            return (await client.post("/v1/completions", json={"model": model, "prompt": "x"})).status_code

        async def chat_routes() -> bool:
            return await status("chat") == 200

        async def sql_is_gone() -> bool:
            return await status("sql") == 404

        async def sql_routes() -> bool:
            return await status("sql") == 200

        await eventually(sql_routes)
        engine.adapters = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
        await eventually(chat_routes)
        engine.adapters = {"chat": "/adapters/chat"}
        await eventually(sql_is_gone)
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["chat", "m"]


@pytest.mark.parametrize("has_load_headers", [True, False])  # Corral's engine, vLLM
async def test_adapter_requests_go_where_the_adapter_runs(has_load_headers: bool) -> None:
    idle = FakeEngine(name="idle", adapters={"sql": "/a"}, health_has_load=has_load_headers)
    running = FakeEngine(name="running", adapters={"sql": "/a"}, health_has_load=has_load_headers)
    idle.lora_info, running.lora_info = LORA_INFO.format("chat"), LORA_INFO.format("sql,chat")
    async with fleet([idle, running]) as (client, urls):

        async def is_known() -> bool:
            seen = await replicas(client)
            return seen[urls[1]]["active_adapters"] == ["chat", "sql"] and seen[urls[0]]["max_lora"] == 2

        await eventually(is_known)
        for _ in range(4):
            response = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
            assert response.json()["served_by"] == "running"
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_adapter_routes_total{affinity="active",model="m"} 4.0' in metrics


async def test_a_waiting_adapter_request_does_not_hold_up_base_requests() -> None:
    """The adapter's only replica is saturated: its request waits in the pool's queue while base
    requests behind it go to the other replica; when its replica has room, it goes first."""
    lora = FakeEngine(name="lora", adapters={"sql": "/a"}, num_waiting=10)
    base = FakeEngine(name="base")
    async with fleet([lora, base], queue_timeout_s=20) as (client, urls):

        async def is_known(num_waiting: int) -> bool:
            seen = await replicas(client)
            return seen[urls[0]]["adapters"] == ["sql"] and seen[urls[1]]["num_waiting"] == num_waiting

        await eventually(lambda: is_known(0))
        adapter = asyncio.create_task(client.post("/v1/completions", json={"model": "sql", "prompt": "a"}))
        await eventually(lambda: is_queued(client, 1))
        for _ in range(3):
            request = client.post("/v1/completions", json={"model": "m", "prompt": "b"})
            served = await asyncio.wait_for(request, 5)  # before: queued behind the adapter request
            assert served.json()["served_by"] == "base"
        assert not adapter.done() and lora.bodies == []
        base.num_waiting = 10  # the base replica saturates too: a base request queues behind
        await eventually(lambda: is_known(10))
        waiting = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "w"}))
        await eventually(lambda: is_queued(client, 2))
        lora.num_waiting = 5  # room for one request there, which either could take
        assert (await adapter).json()["served_by"] == "lora"
        assert (await waiting).json()["served_by"] == "lora"  # after the adapter's, room again
        assert [json.loads(b)["model"] for b in lora.bodies] == ["sql", "m"]


async def is_queued(client: httpx.AsyncClient, num_requests: int) -> bool:
    metric = f'corral_gateway_queue_length{{model="m"}} {float(num_requests)}'
    return metric in (await client.get("/metrics")).text
