"""vLLM's runtime LoRA endpoints through a running gateway in front of fake replicas: a load reaches
every ready replica of the pool (or none, undone where it failed), an unload every replica listing
the adapter, and a replica that comes back without the adapter gets it again."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from corral_gateway import replica_poller
from corral_gateway.app import create_app
from corral_gateway.settings import GatewaySettings

from tests.gateway.conftest import FakeEngine, serve
from tests.gateway.test_gateway_proxy import eventually, fleet, replicas

LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}
LORA_ON = 'vllm:lora_requests_info{max_lora="2"} 1\n'  # as vLLM with --enable-lora reports it


def lora_engine(name: str, **knobs: Any) -> FakeEngine:
    """A fake vLLM replica with LoRA on (its /metrics says so) and its runtime routes."""
    return FakeEngine(name=name, lora_info=LORA_ON, **knobs)


@pytest.fixture(autouse=True)
def _quick_adapter_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_poller, "_ADAPTERS_CHECK_INTERVAL_S", 0.05)


async def _all_listed(client: httpx.AsyncClient, num_replicas: int) -> None:
    """Wait until every replica's model list has been read (the replicas are ready)."""

    async def is_read() -> bool:
        states = (await replicas(client)).values()
        return len(states) == num_replicas and all(r["served_names"] is not None for r in states)

    await eventually(is_read)


async def test_a_load_reaches_every_replica_and_routes_at_once_and_an_unload_leaves_every_one() -> None:
    a, b = lora_engine("a"), lora_engine("b")
    async with fleet([a, b], policy="round-robin") as (client, urls):
        await _all_listed(client, 2)
        loaded = await client.post("/v1/load_lora_adapter", json=LOAD)
        assert loaded.status_code == 200
        assert loaded.text == "Success: LoRA adapter 'sql' added successfully."
        assert a.adapters == b.adapters == {"sql": "/adapters/sql"}
        # Routed as soon as the load answered: the gateway read both lists before answering.
        assert {url: r["adapters"] for url, r in (await replicas(client)).items()} == {
            url: ["sql"] for url in urls
        }
        served = [(await client.post("/v1/completions", json={"model": "sql", "prompt": str(i)})).json()
                  for i in range(4)]  # fmt: skip
        assert {s["served_by"] for s in served} == {"a", "b"}
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_adapter_routes_total{affinity="full",model="m"} 0.0' in metrics
        again = await client.post("/v1/load_lora_adapter", json=LOAD)  # idempotent
        assert again.status_code == 200 and a.adapters == b.adapters == {"sql": "/adapters/sql"}
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert unloaded.status_code == 200
        assert unloaded.text == "Success: LoRA adapter 'sql' removed successfully."
        assert a.adapters == b.adapters == {}
        gone = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"


async def test_a_load_failing_on_one_replica_is_undone_where_it_loaded_and_names_the_replica() -> None:
    # b had the adapter before: the failed load leaves it there; a loaded it, and loses it again.
    a, b = lora_engine("a"), lora_engine("b", adapters={"sql": "/adapters/sql"})
    c = lora_engine("c", lora_load_status=404)
    async with fleet([a, b, c]) as (client, urls):
        await _all_listed(client, 3)
        failed = await client.post("/v1/load_lora_adapter", json=LOAD)
        assert failed.status_code == 404
        error = failed.json()["error"]
        assert error["type"] == "NotFoundError" and error["param"] == "lora_path"
        assert f"1 of 3 replicas of `m` ({urls[2]}: HTTP 404 (No adapter found))" in error["message"]
        assert f"unloaded again from {urls[0]}." in error["message"]
        assert a.adapters == {} and b.adapters == {"sql": "/adapters/sql"} and c.adapters == {}
        assert ("unload", "sql") in a.lora_calls and ("unload", "sql") not in b.lora_calls
        # Not remembered: a replica coming back without it is not given it.
        assert not any(r["adapters"] for url, r in (await replicas(client)).items() if url != urls[1])


async def test_a_replica_back_without_a_loaded_adapter_gets_it_before_it_takes_its_requests() -> None:
    # Corral engines with LoRA on: load headers on /health, with the models version.
    a, b = (FakeEngine(name=n, health_has_load=True, models_version="0") for n in "ab")
    async with fleet([a, b]) as (client, urls):
        await _all_listed(client, 2)
        assert (await client.post("/v1/load_lora_adapter", json=LOAD)).status_code == 200
        # b restarts: down for a while, then up without the adapter.
        b.is_healthy = False
        await eventually(lambda: _is_failing(client, urls[1]))
        b.adapters.clear()
        b.lora_calls.clear()
        b.is_healthy = True

        async def is_given_it() -> bool:
            return b.adapters == {"sql": "/adapters/sql"}

        await eventually(is_given_it)
        await eventually(lambda: _lists(client, urls[1], "sql"))
        assert b.lora_calls == [("load", "sql")]  # once
        # Unloaded: forgotten, so b's next return does not bring it back.
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 200
        assert a.adapters == b.adapters == {}


async def _is_failing(client: httpx.AsyncClient, url: str) -> bool:
    state = (await replicas(client))[url]
    return bool(state["num_consecutive_failures"] or state["ejected"])


async def _lists(client: httpx.AsyncClient, url: str, adapter: str) -> bool:
    return adapter in (await replicas(client))[url]["adapters"]


@contextlib.asynccontextmanager
async def _pools(
    engines: dict[str, FakeEngine], **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    """A gateway with one pool per engine (named as the engine), each engine serving that name."""
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for pool, engine in engines.items():
            engine.served_names = (pool,)
            urls[pool] = (await stack.enter_async_context(serve(engine.app())))[0]
        backends = {pool: [url] for pool, url in urls.items()}
        app = create_app(GatewaySettings(backends=backends, poll_interval_s=0.02, **settings))
        gw_url, _ = await stack.enter_async_context(serve(app))
        yield await stack.enter_async_context(httpx.AsyncClient(base_url=gw_url, timeout=10)), urls


async def test_the_base_model_picks_the_pool_and_without_it_several_lora_pools_are_named() -> None:
    llama = FakeEngine(name="llama", adapters={"chat": "/adapters/chat"})
    qwen = lora_engine("qwen")
    plain = FakeEngine(name="plain")  # no LoRA: never a choice
    async with _pools({"llama": llama, "qwen": qwen, "plain": plain}) as (client, _):

        async def is_known() -> bool:
            models = (await client.get("/v1/models")).json()["data"]
            return "chat" in {m["id"] for m in models}

        await eventually(is_known)
        ambiguous = await client.post("/v1/load_lora_adapter", json=LOAD)
        assert ambiguous.status_code == 400
        error = ambiguous.json()["error"]
        assert error["code"] == "model_ambiguous" and error["param"] == "base_model_name"
        assert "(`llama`, `qwen`)" in error["message"]
        loaded = await client.post("/v1/load_lora_adapter", json=LOAD | {"base_model_name": "qwen"})
        assert (
            loaded.status_code == 200
            and qwen.adapters == {"sql": "/adapters/sql"}
            and llama.adapters == {"chat": "/adapters/chat"}
        )
        chat = {"lora_name": "chat", "lora_path": "/adapters/chat", "base_model_name": "qwen"}
        served_elsewhere = await client.post("/v1/load_lora_adapter", json=chat)
        assert served_elsewhere.status_code == 400 and "served for `llama`" in served_elsewhere.text
        assert "chat" not in qwen.adapters
        unknown = await client.post("/v1/load_lora_adapter", json=LOAD | {"base_model_name": "nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "base_model_name"
        taken = await client.post("/v1/load_lora_adapter", json={**LOAD, "lora_name": "plain"})
        assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
        # The unload finds the adapter's pool from its name.
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 200
        assert qwen.adapters == {}


async def test_a_pool_without_a_ready_replica_answers_503() -> None:
    async with fleet([], extra_urls=["http://127.0.0.1:9"]) as (client, _):
        response = await client.post("/v1/load_lora_adapter", json=LOAD | {"base_model_name": "m"})
        assert response.status_code == 503 and response.headers["retry-after"]


async def test_loading_needs_an_api_key_where_the_gateway_has_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("secret\n")
    engine = lora_engine("a")
    async with fleet([engine], api_keys_file=keys) as (client, _):
        refused = await client.post("/v1/load_lora_adapter", json=LOAD)
        assert refused.status_code == 401 and engine.lora_calls == []
        client.headers["authorization"] = "Bearer secret"
        await _all_listed(client, 1)
        assert (await client.post("/v1/load_lora_adapter", json=LOAD)).status_code == 200
        assert engine.lora_calls == [("load", "sql")]
