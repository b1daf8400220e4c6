"""OpenAI's Responses API through the gateway: a stream that ends at its terminal event (no
`[DONE]`) and then loses its connection gets no error event after it, one that breaks before it
ends the Responses way (an `error` event and `response.failed`, no `[DONE]`), and a stored
response's routes (GET, DELETE, input_items, cancel) are OpenAI-style 404s saying nothing is
stored."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from corral_gateway.body_reader import BodyReader, ReportedUsage
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_drain import gateway
from tests.gateway.test_gateway_proxy import fleet

# Longer than the gateway's usage tail (4 KiB): the terminal event carries the whole response.
_TEXT = "word " * 2000


def _event(kind: str, **fields: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def _events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(name, data) of each event of a Responses stream's body."""
    events = []
    for block in body.decode().strip().split("\n\n"):
        name, data = block.split("\n", 1)
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


@dataclass
class ResponsesEngine(FakeEngine):
    """A replica whose Responses stream ends with `terminal` and then its connection breaks; with
    `terminal` None it breaks after the text, before any terminal event."""

    terminal: str | None = "response.completed"
    hang_s: float = 0.0  # before breaking (with no terminal event): a stream still open, for a drain

    def app(self) -> Starlette:
        app = super().app()
        app.router.routes.insert(0, Route("/v1/responses", self.responses, methods=["POST"]))
        return app

    async def responses(self, request: Request) -> Response:
        await request.body()
        return StreamingResponse(self._events(), media_type="text/event-stream")

    async def _events(self) -> AsyncIterator[bytes]:
        created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
        yield _event("response.created", response=created, sequence_number=0)
        # A model may write anything, an event line's look included: it is data, not an event.
        yield _event(
            "response.output_text.delta",
            delta='\nevent: response.completed\n\n"sequence_number": 99 ',
            sequence_number=1,
        )
        if self.terminal is not None:
            done = {"id": "resp_1", "output_text": _TEXT}
            last = _event(self.terminal, response=done, sequence_number=2)
            yield last[:14]  # the event line split across chunks
            yield last[14:]
        await asyncio.sleep(self.hang_s)
        raise RuntimeError("replica died")  # the body's own end is lost


def _stream_body() -> dict[str, object]:
    return {"model": "m", "input": "hi", "stream": True}


@pytest.mark.parametrize("terminal", ["response.completed", "response.incomplete", "response.failed"])
async def test_a_stream_that_had_sent_its_terminal_event_gets_no_error_event(terminal: str) -> None:
    async with fleet([ResponsesEngine(terminal=terminal)]) as (client, _):
        async with client.stream("POST", "/v1/responses", json=_stream_body()) as r:
            body = b"".join([chunk async for chunk in r.aiter_raw()])
        assert body.endswith(b'"sequence_number": 2}\n\n') and f"event: {terminal}\n".encode() in body
        assert b'"error"' not in body and b"[DONE]" not in body
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 0.0' in metrics


def _assert_failed_the_responses_way(body: bytes, code: str, error_type: str) -> None:
    """The stream's last events are `error` and `response.failed`, numbered on from the replica's,
    with no chat `[DONE]`."""
    assert b"[DONE]" not in body
    events = _events(body)
    assert [name for name, _ in events] == [
        "response.created",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    (_, error), (_, failed) = events[-2:]
    assert error["type"] == "error" and error["code"] == code and error["param"] is None
    assert error["error"] == {"message": error["message"], "type": error_type, "param": None, "code": code}
    assert failed["type"] == "response.failed"
    assert [error["sequence_number"], failed["sequence_number"]] == [2, 3]
    response = failed["response"]
    assert response["id"] == "resp_1" and response["status"] == "failed" and response["output"] == []
    assert response["error"] == {"code": "server_error", "message": error["message"]}


async def test_a_stream_broken_before_its_terminal_event_ends_the_responses_way() -> None:
    async with fleet([ResponsesEngine(terminal=None)]) as (client, _):
        async with client.stream("POST", "/v1/responses", json=_stream_body()) as r:
            body = b"".join([chunk async for chunk in r.aiter_raw()])
        _assert_failed_the_responses_way(body, "upstream_disconnected", "upstream_error")
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 1.0' in metrics


async def test_the_openai_library_raises_a_broken_responses_stream_as_an_api_error() -> None:
    async with fleet([ResponsesEngine(terminal=None)]) as (client, _):
        sdk = openai.AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="unused", max_retries=0)
        seen = []
        stream = await sdk.responses.create(model="m", input="hi", stream=True)
        with pytest.raises(openai.APIError) as raised:
            async for event in stream:
                seen.append(event.type)
        await sdk.close()
    assert seen == ["response.created", "response.output_text.delta"]
    assert raised.value.message == "The model replica failed while streaming the response."
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "upstream_disconnected"


async def test_a_responses_stream_open_at_the_drains_end_ends_the_responses_way() -> None:
    async with gateway([ResponsesEngine(terminal=None, hang_s=3600)], drain_timeout_s=0.3) as gw:
        async with gw.client.stream("POST", "/v1/responses", json=_stream_body()) as r:
            chunks = r.aiter_raw()
            first = await anext(chunks)
            gw.sigterm()
            body = first + b"".join([chunk async for chunk in chunks])
        _assert_failed_the_responses_way(body, "draining", "service_unavailable")


def test_stream_end_reads_event_lines_not_data() -> None:
    end = BodyReader()
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


def test_stream_end_keeps_a_responses_streams_created_response_and_last_number() -> None:
    end = BodyReader()
    created = _event("response.created", response={"id": "r"}, sequence_number=0)
    for piece in (created[:9], created[9:] + b'event: response.output_text.delta\ndata: {"sequence_num'):
        end.feed(piece)
    assert end.is_responses and end.created_response() == {"id": "r"} and end.last_sequence_number == 0
    end.feed(b'ber": 17, "delta": "\\"sequence_number\\": 99"}\n\n')  # split key; a model's text
    assert end.last_sequence_number == 17
    chat = BodyReader()
    chat.feed(b'data: {"id": "x"}\n\n')
    assert not chat.is_responses and chat.created_response() is None


def test_body_reader_numbers_on_from_the_last_whole_event_of_a_chunk() -> None:
    """A chunk of whole events that ends inside the next one's number: the last whole event's
    number is the one to go on from (not an older chunk's), so no number is sent twice."""
    reader = BodyReader()
    reader.feed(_event("response.created", response={"id": "r"}, sequence_number=0))
    deltas = [_event("response.output_text.delta", delta="a", sequence_number=n) for n in (1, 2, 3)]
    reader.feed(deltas[0] + deltas[1] + deltas[2][: deltas[2].index(b": 3") + 2])
    assert reader.last_sequence_number == 2
    reader.feed(deltas[2][deltas[2].index(b": 3") + 2 :])
    assert reader.last_sequence_number == 3 and not reader.has_ended()


def test_body_reader_reads_a_terminal_event_larger_than_its_tail_in_one_chunk() -> None:
    reader = BodyReader()
    reader.feed(_event("response.created", response={"id": "r"}, sequence_number=0))
    for n in range(1, 200):  # long enough for the kept bytes to be cut back many times
        reader.feed(_event("response.output_text.delta", delta="word " * 10, sequence_number=n))
    usage = {"input_tokens": 7, "output_tokens": 199, "total_tokens": 206}
    done = {"id": "r", "output_text": _TEXT * 3, "usage": usage}
    reader.feed(_event("response.completed", response=done, sequence_number=200))
    assert reader.has_ended() and reader.is_responses and reader.last_sequence_number == 200
    assert reader.created_response() == {"id": "r"} and reader.reported() == ReportedUsage(7, 199, 206)
    assert reader.end(4) == b"0}\n\n"


def test_body_reader_end_is_only_the_bytes_the_body_sent() -> None:
    reader = BodyReader(is_events=False)
    assert reader.end(4) == b""
    reader.feed(b"da")
    assert reader.end(4) == b"da" and not reader.has_ended()
    reader.feed(b"ta: [DONE]\n\n")
    assert reader.end(4) == b"E]\n\n" and reader.has_ended() and not reader.is_responses


def test_body_reader_keeps_a_first_event_whose_end_is_split_across_chunks() -> None:
    reader = BodyReader()
    created = _event("response.created", response={"id": "r"}, sequence_number=0)
    for piece in (created[:-1], created[-1:], _event("response.in_progress", sequence_number=1)):
        reader.feed(piece)
    assert reader.created_response() == {"id": "r"} and reader.last_sequence_number == 1


@dataclass
class PackedResponsesEngine(ResponsesEngine):
    """Sends whole events and the start of the next in one chunk, cut inside its number, then dies."""

    async def _events(self) -> AsyncIterator[bytes]:
        yield _event("response.created", response={"id": "resp_1", "output": []}, sequence_number=0)
        deltas = [_event("response.output_text.delta", delta="a", sequence_number=n) for n in (1, 2, 3)]
        yield deltas[0] + deltas[1] + deltas[2][: deltas[2].index(b": 3") + 2]
        raise RuntimeError("replica died")


async def test_a_stream_broken_inside_an_events_number_numbers_its_error_events_on() -> None:
    async with (
        fleet([PackedResponsesEngine(terminal=None)]) as (client, _),
        client.stream("POST", "/v1/responses", json=_stream_body()) as r,
    ):
        body = b"".join([chunk async for chunk in r.aiter_raw()])
    whole = [block for block in body.decode().split("\n\n") if block.rstrip().endswith("}")]
    numbers = [json.loads(block.split("data: ", 1)[1])["sequence_number"] for block in whole]
    assert [block.split("\n", 1)[0] for block in whole[-2:]] == ["event: error", "event: response.failed"]
    assert numbers == [0, 1, 2, 3, 4]  # each number once, in order


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
