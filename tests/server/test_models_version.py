"""The `x-corral-models-version` header: with --enable-lora, every response (probes included) says
which adapters are served, changing on each load and unload; without LoRA it is absent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from corral_engine import wire
from corral_engine.lora import AdapterRegistry, LoraRequest, startup_adapters
from corral_engine.server import create_app

from tests.server.fake_engine import FakeEngine

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


class _LoraEngine(FakeEngine):
    """The fake engine, taking any adapter it is given (the server's bookkeeping is under test)."""

    async def add_lora(self, lora: LoraRequest) -> None:
        pass

    def remove_lora(self, lora_id: int) -> None:
        pass


@asynccontextmanager
async def _client(adapters: AdapterRegistry | None) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(_LoraEngine(), adapters=adapters, allow_runtime_lora_updating=adapters is not None)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client


async def _version(client: httpx.AsyncClient) -> str:
    response = await client.get("/health")
    assert response.status_code == 200
    return response.headers[wire.HEADER_MODELS_VERSION]


async def test_the_version_changes_with_every_load_and_unload() -> None:
    async with _client(AdapterRegistry(startup_adapters(("sql=/adapters/sql",)))) as client:
        started = await _version(client)
        loaded = await client.post(LOAD, json={"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert loaded.status_code == 200
        with_chat = loaded.headers[wire.HEADER_MODELS_VERSION]  # the load's own answer says it
        assert with_chat != started and await _version(client) == with_chat
        refused = await client.post(LOAD, json={"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert refused.status_code == 400 and await _version(client) == with_chat
        assert (await client.post(UNLOAD, json={"lora_name": "chat"})).status_code == 200
        assert await _version(client) == started  # the same adapters served as at the start
        await client.post(LOAD, json={"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert await _version(client) not in (started, with_chat)  # the same name, loaded anew
        metrics = await client.get("/metrics")
        assert metrics.headers[wire.HEADER_MODELS_VERSION] == await _version(client)


async def test_an_engine_started_again_with_the_same_adapters_has_the_same_version() -> None:
    modules = ("sql=/adapters/sql", "chat=/adapters/chat")
    async with _client(AdapterRegistry(startup_adapters(modules))) as first:
        version = await _version(first)
    async with _client(AdapterRegistry(startup_adapters(modules))) as second:
        assert await _version(second) == version
    async with _client(AdapterRegistry()) as none_yet:
        assert await _version(none_yet) != version


async def test_no_version_without_lora() -> None:
    async with _client(None) as client:
        for response in (await client.get("/health"), await client.get("/v1/models")):
            assert response.status_code == 200
            assert wire.HEADER_NUM_RUNNING in response.headers
            assert wire.HEADER_MODELS_VERSION not in response.headers
