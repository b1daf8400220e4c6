"""A streamed response's end: the last token's chunk, the usage chunk, `[DONE]` and the end of the
body leave in one ASGI message (one socket write), whether the run is read or listened to; a run
of several prompts still sends each prompt's last chunk as it comes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from corral_engine.server import create_app
from corral_engine.server.streaming import ChunkWriter

from tests.server.asgi_call import AsgiCall
from tests.server.fake_engine import FakeEngine

MODEL = FakeEngine.served_model_name


def events(message: dict[str, Any]) -> list[str]:
    """The SSE data lines of one body message."""
    text = message["body"].decode()
    return [part[len("data: ") :] for part in text.split("\n\n") if part]


async def stream(
    engine: FakeEngine, body: dict[str, Any], path: str = "/v1/completions"
) -> list[dict[str, Any]]:
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        call = AsgiCall(app, {"model": MODEL, "stream": True, **body})
        await asyncio.wait_for(call.run(path), 5)
    assert call.sent[0]["type"] == "http.response.start" and call.sent[0]["status"] == 200
    return [m for m in call.sent if m["type"] == "http.response.body"]


@pytest.mark.parametrize("include_usage", [True, False])
async def test_the_last_token_usage_and_done_end_the_body_in_one_message(
    engine: FakeEngine, include_usage: bool
) -> None:
    body = {"prompt": "a", "max_tokens": 5, "stream_options": {"include_usage": include_usage}}
    bodies = await stream(engine, body)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    for m in bodies[:-1]:  # one token's chunk a message, none finished
        (event,) = events(m)
        assert json.loads(event)["choices"][0]["finish_reason"] is None
    last = events(bodies[-1])
    assert last[-1] == "[DONE]"
    finished = json.loads(last[0])
    assert finished["choices"][0]["finish_reason"] == "length" and finished["choices"][0]["text"]
    if include_usage:
        assert len(last) == 3 and json.loads(last[1])["usage"]["completion_tokens"] == 5
    else:
        assert len(last) == 2
    assert len(bodies) == 5  # four tokens on their own, the fifth with the end


async def test_a_chat_stream_ends_the_same_way(engine: FakeEngine) -> None:
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3}
    bodies = await stream(engine, body, "/v1/chat/completions")
    last = events(bodies[-1])
    assert bodies[-1]["more_body"] is False and last[-1] == "[DONE]"
    assert json.loads(last[-2])["choices"][0]["finish_reason"] == "length"
    assert all(m["more_body"] for m in bodies[:-1])


async def test_several_prompts_send_each_last_chunk_as_it_comes(engine: FakeEngine) -> None:
    body = {"prompt": ["a", "b"], "max_tokens": 3, "stream_options": {"include_usage": True}}
    bodies = await stream(engine, body)
    last = events(bodies[-1])
    assert bodies[-1]["more_body"] is False
    assert len(last) == 2 and json.loads(last[0])["usage"]["completion_tokens"] == 6 and last[1] == "[DONE]"
    chunks = [json.loads(e) for m in bodies[:-1] for e in events(m)]
    assert len(chunks) == 6
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]


async def test_the_writer_ends_the_body_with_the_last_write_even_behind_a_waiting_send() -> None:
    sent: list[dict[str, Any]] = []
    writable = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if not writable.is_set():
            await writable.wait()
        sent.append(message)

    writer = ChunkWriter(send)
    writer.write(b"a")  # waits
    writer.write(b"b")
    writer.write(b"c", last=True)
    writer.write(b"d")  # after the end: dropped
    writable.set()
    await asyncio.wait_for(writer.drain(), 5)
    assert [(m["body"], m["more_body"]) for m in sent] == [(b"a", True), (b"bc", False)]

    sent.clear()
    straight = ChunkWriter(send)
    straight.write(b"x", last=True)
    straight.write(b"y")
    assert [(m["body"], m["more_body"]) for m in sent] == [(b"x", False)]
