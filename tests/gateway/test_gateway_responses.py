"""OpenAI's Responses API through the gateway: a stream that ends at its terminal event (no
`[DONE]`) and then loses its connection gets no error event after it, and a stored response's
routes (GET, DELETE, input_items, cancel) are OpenAI-style 404s saying nothing is stored."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from corral_gateway.stream_end import StreamEnd
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import fleet

# Longer than the gateway's usage tail (4 KiB): the terminal event carries the whole response.
_TEXT = "word " * 2000


def _event(kind: str, **fields: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


@dataclass
class ResponsesEngine(FakeEngine):
    """A replica whose Responses stream ends with `terminal` and then its connection breaks; with
    `terminal` None it breaks after the text, before any terminal event."""

    terminal: str | None = "response.completed"

    def app(self) -> Starlette:
        app = super().app()
        app.router.routes.insert(0, Route("/v1/responses", self.responses, methods=["POST"]))
        return app

    async def responses(self, request: Request) -> Response:
        await request.body()
        return StreamingResponse(self._events(), media_type="text/event-stream")

    async def _events(self) -> AsyncIterator[bytes]:
        yield _event("response.created", response={"id": "resp_1"})
        # A model may write anything, an event line's look included: it is data, not an event.
        yield _event("response.output_text.delta", delta="\nevent: response.completed\n\n")
        if self.terminal is not None:
            last = _event(self.terminal, response={"id": "resp_1", "output_text": _TEXT})
            yield last[:14]  # the event line split across chunks
            yield last[14:]
        raise RuntimeError("replica died")  # the body's own end is lost


def _stream_body() -> dict[str, object]:
    return {"model": "m", "input": "hi", "stream": True}


@pytest.mark.parametrize("terminal", ["response.completed", "response.incomplete", "response.failed"])
async def test_a_stream_that_had_sent_its_terminal_event_gets_no_error_event(terminal: str) -> None:
    async with fleet([ResponsesEngine(terminal=terminal)]) as (client, _):
        async with client.stream("POST", "/v1/responses", json=_stream_body()) as r:
            body = b"".join([chunk async for chunk in r.aiter_raw()])
        assert body.endswith(b'"}}\n\n') and f"event: {terminal}\n".encode() in body
        assert b'"error"' not in body and b"[DONE]" not in body
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 0.0' in metrics


async def test_a_stream_broken_before_its_terminal_event_ends_with_an_error_event() -> None:
    async with fleet([ResponsesEngine(terminal=None)]) as (client, _):
        async with client.stream("POST", "/v1/responses", json=_stream_body()) as r:
            body = b"".join([chunk async for chunk in r.aiter_raw()])
        assert b'"code": "upstream_disconnected"' in body and body.endswith(b"data: [DONE]\n\n")
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 1.0' in metrics


def test_stream_end_reads_event_lines_not_data() -> None:
    end = StreamEnd()
    for piece in (
        b"event: response.created\ndata: {}\n\n",
        b'data: {"delta": "\\nevent: response.completed"}\n\n',
    ):
        end.feed(piece)
    assert not end.has_ended()
    end.feed(b"event: response.incomplete\r\ndata: {}\r\n\r\n")
    assert end.has_ended()
    end.feed(b'event: error\ndata: {"type": "error"}\n\n')
    assert not end.has_ended()
    end.feed(b"data: [DONE]\n\n")
    assert end.has_ended()


async def test_stored_response_routes_are_404s_saying_nothing_is_stored() -> None:
    engine = FakeEngine()
    async with fleet([engine]) as (client, _):
        for method, path in [
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("GET", "/v1/responses/resp_1/input_items"),
            ("POST", "/v1/responses/resp_1/cancel"),
        ]:
            r = await client.request(method, path)
            assert r.status_code == 404, (method, path)
            error = r.json()["error"]
            assert error["code"] == "not_found" and error["param"] == "response_id"
            assert "`resp_1`: responses are not stored" in error["message"]
            assert r.headers["x-request-id"]
        created = await client.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert created.status_code == 200 and created.json()["path"] == "/v1/responses"
    assert len(engine.bodies) == 1  # only the POST reached the replica
