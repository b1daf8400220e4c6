"""Retries when a model's only replica fails a request before its first byte: the same replica is
tried again after a back-off while attempts remain; a dead one still ends in a 503 to retry later."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from corral_gateway.upstream import ConnectTimedOut, Upstream

from tests.gateway.conftest import FakeEngine, serve
from tests.gateway.test_gateway_proxy import dead_url, fleet

COMPLETION = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize("is_stream", [False, True])
async def test_a_connect_timeout_on_a_models_only_replica_is_retried_there(
    monkeypatch: pytest.MonkeyPatch, is_stream: bool
) -> None:
    """As under a burst on a saturated machine: the gateway's event loop stalled past the connect
    timeout, so a connect the kernel had completed counted as timed out (it was a 503 at once)."""
    post = Upstream.post
    num_timeouts = [1]

    async def times_out_once(self: Upstream, url: str, body: bytes, headers: Any, is_stream: bool) -> Any:
        if url.endswith("/v1/completions") and num_timeouts[0]:
            num_timeouts[0] -= 1
            raise ConnectTimedOut("ConnectionTimeoutError")
        return await post(self, url, body, headers, is_stream)

    monkeypatch.setattr(Upstream, "post", times_out_once)
    engine = FakeEngine()
    async with fleet([engine]) as (client, _):
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": is_stream})
        assert response.status_code == 200 and b"fake" in response.content
        assert len(engine.bodies) == 1 and num_timeouts == [0]
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_retries_total{model="m",reason="connect_timeout"} 1.0' in metrics


@asynccontextmanager
async def resetting_first_posts(target_url: str, num_resets: int) -> AsyncIterator[str]:
    """A loopback relay to `target_url`, one request per connection (it asks for `Connection:
    close`), that resets the connection of the first `num_resets` POSTs once their head arrived."""
    host, port = target_url.removeprefix("http://").rsplit(":", 1)
    remaining = [num_resets]

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if head.startswith(b"POST ") and remaining[0] > 0:
            remaining[0] -= 1
            writer.transport.abort()  # the body unread: the kernel answers with a reset
            return
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        up_writer.write(head[:-2] + b"connection: close\r\n\r\n")

        async def upload() -> None:
            while data := await reader.read(65536):
                up_writer.write(data)

        uploading = asyncio.create_task(upload())
        while data := await up_reader.read(65536):
            writer.write(data)
            await writer.drain()
        uploading.cancel()
        up_writer.close()
        writer.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_a_reset_before_the_first_byte_on_a_models_only_replica_is_retried_there() -> None:
    engine = FakeEngine()
    async with (
        serve(engine.app()) as (engine_url, _),
        resetting_first_posts(engine_url, 2) as relay_url,
        fleet([], extra_urls=[relay_url]) as (client, _),
    ):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 200 and response.json()["served_by"] == "fake"
        assert len(engine.bodies) == 1
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_retries_total{model="m",reason="transport_error"} 2.0' in metrics


async def test_a_dead_only_replica_is_tried_max_attempts_times_then_a_503_to_retry_later() -> None:
    async with fleet([], extra_urls=[dead_url()], max_attempts=3) as (client, _):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        assert response.json()["error"]["code"] == "model_unavailable"
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_retries_total{model="m",reason="connect_error"} 3.0' in metrics


async def test_a_5xx_from_a_models_only_replica_is_passed_on_not_retried() -> None:
    # Its own answer, not a failure to reach it: the client gets what the engine said.
    engine = FakeEngine(mode="error500")
    async with fleet([engine]) as (client, _):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 500 and len(engine.bodies) == 1
