"""The gateway stopping on SIGTERM (its server's signal handler, called as the signal would), in
front of fake replicas on 127.0.0.1: refuse new requests, fail queued ones, let open ones finish up
to drain_timeout_s, then end the rest with a `draining` error."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from corral_gateway.app import GatewayApp, create_app
from corral_gateway.drain import Drain, DrainingServer
from corral_gateway.settings import GatewaySettings

from tests.gateway.conftest import FakeEngine, serve, start_serving
from tests.gateway.test_gateway_proxy import eventually

STREAM = {"model": "m", "prompt": "x", "stream": True}


@dataclass
class Gateway:
    client: httpx.AsyncClient
    app: GatewayApp
    server: DrainingServer
    task: asyncio.Task[None]

    def sigterm(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)


@asynccontextmanager
async def gateway(engines: list[FakeEngine], **settings: Any) -> AsyncIterator[Gateway]:
    async with AsyncExitStack() as stack:
        urls = [(await stack.enter_async_context(serve(e.app())))[0] for e in engines]
        app = create_app(GatewaySettings(backends={"m": urls}, poll_interval_s=0.02, **settings))
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="critical", lifespan="on", timeout_graceful_shutdown=3
        )
        server = DrainingServer(config, app.drain)
        task, port = await start_serving(server)
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
        )
        try:
            yield Gateway(client, app, server, task)
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)


async def _done(task: asyncio.Task[Any]) -> bool:
    return task.done()


async def test_a_draining_gateway_refuses_new_requests_and_readiness_but_stays_alive() -> None:
    async with gateway([FakeEngine(mode="hang")], drain_timeout_s=30) as gw:
        stream = gw.client.stream("POST", "/v1/completions", json=STREAM)
        async with stream as open_stream:  # keeps the drain from ending at once
            gw.sigterm()
            refused = await gw.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"] == {
                "message": "The gateway is shutting down; retry the request.",
                "type": "service_unavailable",
                "param": None,
                "code": "draining",
            }
            # A keep-alive client is told to reconnect (through its Service, to another gateway).
            assert refused.headers["connection"] == "close"
            ready = await gw.client.get("/ready")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
            assert (await gw.client.get("/health")).status_code == 200  # liveness: still serving
            assert open_stream.status_code == 200 and not gw.task.done()


async def test_queued_requests_get_a_503_as_soon_as_the_drain_begins() -> None:
    engine = FakeEngine(num_waiting=10)  # reports a long queue: saturated, requests queue
    async with gateway([engine], queue_timeout_s=60, drain_timeout_s=30) as gw:

        async def is_saturated_known() -> bool:
            data = (await gw.client.get("/corral/replicas")).json()["models"]["m"]
            return bool(data[0]["num_waiting"] >= 10)

        await eventually(is_saturated_known)
        queued = asyncio.create_task(gw.client.post("/v1/completions", json={"model": "m", "prompt": "x"}))

        async def is_queued() -> bool:
            metrics = (await gw.client.get("/metrics")).text
            return 'corral_gateway_queue_length{model="m"} 1.0' in metrics

        await eventually(is_queued)
        gw.sigterm()
        response = await asyncio.wait_for(queued, 5)  # not after queue_timeout_s nor the drain's 30 s
        assert response.status_code == 503 and response.json()["error"]["code"] == "draining"
        await eventually(lambda: _done(gw.task))  # nothing was open: the server stopped


async def test_open_streams_finish_then_the_server_stops() -> None:
    engine = FakeEngine(num_chunks=6, chunk_delay_s=0.1)
    async with gateway([engine], drain_timeout_s=30) as gw:
        async with gw.client.stream("POST", "/v1/completions", json=STREAM) as r:
            chunks = r.aiter_raw()
            first = await anext(chunks)
            gw.sigterm()
            body = first + b"".join([chunk async for chunk in chunks])
        assert body.endswith(b'"i": 5, "served_by": "fake"}\n\ndata: [DONE]\n\n')
        await eventually(lambda: _done(gw.task))


async def test_requests_still_open_at_the_drain_timeout_end_with_a_draining_error() -> None:
    engine = FakeEngine(mode="hang")  # a stream stalls after its first event; a whole answer never comes
    async with gateway([engine], drain_timeout_s=0.3) as gw:
        whole = asyncio.create_task(gw.client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
        async with gw.client.stream("POST", "/v1/completions", json=STREAM) as r:
            chunks = r.aiter_raw()
            first = await anext(chunks)
            gw.sigterm()
            body = first + b"".join([chunk async for chunk in chunks])
        events = body.decode().split("\n\n")
        assert events[0] == 'data: {"i": 0, "served_by": "fake"}'
        assert events[-2:] == ["data: [DONE]", ""]
        error = json.loads(events[-3].removeprefix("data: "))["error"]
        assert error["code"] == "draining" and error["type"] == "service_unavailable"
        response = await whole
        assert response.status_code == 503 and response.json()["error"]["code"] == "draining"

        async def upstreams_closed() -> bool:  # the replica aborts what nobody will read
            return engine.num_active == 0 and engine.num_cancelled == 2

        await eventually(upstreams_closed)
        await eventually(lambda: _done(gw.task))


async def test_a_second_signal_ends_open_streams_at_once_with_the_error_and_stops_cleanly() -> None:
    """Ctrl-C twice (`corral up` in a terminal): the open stream gets the `draining` error event
    and `[DONE]` now, not after drain_timeout_s, and the server stops as a drain does, running
    the app's shutdown. uvicorn's forced exit cut the stream mid-body and skipped the shutdown."""
    engine = FakeEngine(mode="hang")
    async with gateway([engine], drain_timeout_s=30) as gw:
        async with gw.client.stream("POST", "/v1/completions", json=STREAM) as r:
            chunks = r.aiter_raw()
            first = await anext(chunks)
            gw.sigterm()
            gw.server.handle_exit(signal.SIGINT, None)
            body = first + b"".join([chunk async for chunk in chunks])
        events = body.decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == "draining"
        await eventually(lambda: _done(gw.task))
        assert not gw.server.force_exit


async def test_a_double_ctrl_c_with_nothing_open_stops_cleanly() -> None:
    """Nothing open: the first signal's drain is over at once, and the second (a terminal's
    double press) must not turn that into a forced exit, which skips the app's shutdown."""
    async with gateway([FakeEngine()], drain_timeout_s=30) as gw:
        gw.sigterm()
        await eventually(lambda: _is_stopping(gw.server))
        gw.server.handle_exit(signal.SIGINT, None)
        await eventually(lambda: _done(gw.task))
        assert not gw.server.force_exit


async def _is_stopping(server: DrainingServer) -> bool:
    return server.should_exit


def test_the_drain_ends_open_requests_only_once_its_time_is_up() -> None:
    now = [0.0]
    drain = Drain(10.0, clock=lambda: now[0])
    assert not drain.poll()  # not begun
    loop = asyncio.new_event_loop()
    try:
        ended = loop.create_future()
        with drain.tracking(ended):
            drain.begin()
            now[0] = 9.9
            assert not drain.poll() and not ended.done()
            now[0] = 10.0
            assert drain.poll() and ended.done() and drain.is_over
    finally:
        loop.close()
    assert Drain(10.0).num_open == 0


async def test_the_access_line_of_a_stream_ended_by_the_drain_has_the_status_the_client_got(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "corral_gateway.access")
    async with gateway([FakeEngine(mode="hang")], drain_timeout_s=0.3) as gw:
        whole = asyncio.create_task(gw.client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
        async with gw.client.stream("POST", "/v1/completions", json=STREAM) as r:
            chunks = r.aiter_raw()
            await anext(chunks)
            gw.sigterm()
            assert b'"code": "draining"' in b"".join([chunk async for chunk in chunks])
        assert (await whole).status_code == 503
        await eventually(lambda: _done(gw.task))
    records = [r.__dict__ for r in caplog.records if r.name == "corral_gateway.access"]
    lines = sorted(((r["status"], r["ended"]) for r in records), key=str)
    assert lines == [("200", "draining"), ("503", None)]  # the stream's client got 200, then the error
    assert "status 200 (ended early: draining)" in caplog.text
