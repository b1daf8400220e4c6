"""The engine server's OpenAI surface against a fake engine: shapes, streaming, n, logprobs, stop."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from corral_engine import wire
from corral_engine.sampling_params import SamplingParams

from tests.server.asgi_call import AsgiCall
from tests.server.fake_engine import FakeEngine

MODEL = FakeEngine.served_model_name


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body into JSON payloads, with the terminal [DONE] as the string "[DONE]"."""
    events: list[Any] = []
    for block in body.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_completion_returns_text_usage_and_load_headers(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    for header in (wire.HEADER_NUM_RUNNING, wire.HEADER_NUM_WAITING, wire.HEADER_KV_USAGE):
        assert header in r.headers


async def test_completion_stream_ends_with_usage_and_done(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hell"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["usage"] is None for c in chunks)


async def test_continuous_usage_stats_give_the_usage_so_far_on_every_chunk(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": options}
    events = sse_events((await client.post("/v1/completions", json=body)).text)
    chunks, totals = events[:-2], events[-2]["usage"]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert all(c["usage"]["prompt_tokens"] == totals["prompt_tokens"] for c in chunks)
    assert totals["completion_tokens"] == 4

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "n": 2,
        "temperature": 1.0,
        "stream": True,
        "stream_options": options,
    }
    events = sse_events((await client.post("/v1/chat/completions", json=chat)).text)
    chunks, totals = events[:-2], events[-2]["usage"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[:2] == [0, 0]  # the role chunks carry no token
    assert counts[-1] == totals["completion_tokens"] == 6
    without = {**body, "stream_options": {"include_usage": True}}
    events = sse_events((await client.post("/v1/completions", json=without)).text)
    assert all(c["usage"] is None for c in events[:-2])


async def test_multiple_prompts_and_n_number_choices(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": [[256, 97], [256, 98]], "max_tokens": 3, "n": 2, "temperature": 1.0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    assert r.json()["usage"]["completion_tokens"] == 12
    assert r.json()["usage"]["prompt_tokens"] == 4


async def test_stop_string_ends_with_stop(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 20, "stop": [" wor"]}
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == "hello" and choice["finish_reason"] == "stop" and choice["stop_reason"] == " wor"


async def test_completion_logprobs_shape(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 2}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e", "l"]
    assert lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2]
    assert all(len(top) == 2 for top in lp["top_logprobs"])


async def test_unspaced_special_tokens_decode_the_echo_and_the_logprobs(client: httpx.AsyncClient) -> None:
    """spaces_between_special_tokens false reaches the tokenizer's decode (the echoed prompt's and
    the logprobs' text offsets), as on a slow tokenizer; the fake's BOS decodes to nothing."""
    body = {"model": MODEL, "prompt": [256, 104, 105], "max_tokens": 3, "echo": True, "logprobs": 0}
    for spaced in (True, False):
        r = await client.post("/v1/completions", json={**body, "spaces_between_special_tokens": spaced})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "hihel" and choice["logprobs"]["text_offset"][-3:] == [2, 3, 4]


async def test_chat_completion(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hey"}], "max_completion_tokens": 5}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert out["choices"][0]["finish_reason"] == "length"
    # "<user>hey\n<assistant>" rendered without an extra BOS
    assert out["usage"]["prompt_tokens"] == len("<user>hey\n<assistant>")


async def test_chat_developer_role_reaches_the_template_as_system(client: httpx.AsyncClient) -> None:
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hey"}]
    r = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
    )
    assert r.json()["usage"]["prompt_tokens"] == len("<system>be brief\n<user>hey\n<assistant>")


async def test_chat_default_max_tokens_fills_the_context(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hey"}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.json()["usage"]["total_tokens"] == engine.max_model_len


async def test_chat_stream_chunks_as_openai_sends_them(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
        ],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 1,
        "temperature": 0,
    }
    r = await client.post("/v1/chat/completions", json=body)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content", "") for c in mine) == "hel"
        content_chunks = [c for c in mine if c["delta"].get("content")]
        assert all(len(c["logprobs"]["content"][0]["top_logprobs"]) == 1 for c in content_chunks)
    assert events[-2]["usage"]["completion_tokens"] == 6


async def test_chat_logprobs_non_streaming(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "logprobs": True}
    r = await client.post("/v1/chat/completions", json=body)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["h", "e"]
    assert content[0]["bytes"] == [104] and content[0]["top_logprobs"] == []


async def test_models_and_health(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert (await client.get(f"/v1/models/{MODEL}")).status_code == 200
    assert (await client.get("/v1/models/other")).status_code == 404
    r = await client.get("/health")
    assert r.status_code == 200 and wire.HEADER_KV_USAGE in r.headers


async def test_finished_requests_leave_nothing_in_the_engine(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
    await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "q"}],
            "max_tokens": 2,
            "stream": True,
        },
    )
    assert engine.requests == {}
    assert engine.aborted == []


async def test_only_streams_ask_the_engine_for_an_output_per_step(
    client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A response written at the end asks for the final output only (vLLM's FINAL_ONLY): no
    output, callback or wake-up per step; a stream asks for each step's deltas."""
    kinds: list[tuple[str, bool]] = []
    add_request = engine.add_request

    def recording(request_id: str, prompt: str | list[int], params: SamplingParams, **kw: Any) -> Any:
        kinds.append((params.output_kind, stream))
        return add_request(request_id, prompt, params, **kw)

    monkeypatch.setattr(engine, "add_request", recording)
    chat = {"messages": [{"role": "user", "content": "q"}]}
    for route, fields in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", chat)):
        for stream in (False, True):
            body = {"model": MODEL, "max_tokens": 3, "stream": stream, **fields}
            r = await client.post(route, json=body)
            assert r.status_code == 200, r.text
    assert kinds == [("final_only", False), ("delta", True)] * 2


async def test_a_chat_stream_sends_nothing_before_its_prompt_is_computed() -> None:
    """The role chunk goes out with the first tokens: a gateway takes a response's first bytes for
    the moment its prompt was computed (prefix affinity's prefill ledger)."""
    import asyncio

    from corral_engine.server import create_app

    engine = FakeEngine()
    engine.gate.clear()  # the request waits in the engine's queue
    app = create_app(engine)
    call = AsgiCall(app, {"model": MODEL, "messages": [{"role": "user", "content": "hey"}], "stream": True})

    def body_bytes() -> bytes:
        return b"".join(m.get("body", b"") for m in call.sent if m["type"] == "http.response.body")

    async with app.router.lifespan_context(app):
        task = asyncio.create_task(call.run("/v1/chat/completions"))
        for _ in range(200):  # the response has started and the request waits in the engine
            if any(m["type"] == "http.response.start" for m in call.sent) and engine.requests:
                break
            await asyncio.sleep(0)
        for _ in range(50):
            await asyncio.sleep(0)
        assert engine.requests and body_bytes() == b""
        engine.gate.set()
        await asyncio.wait_for(task, 10)
        events = sse_events(body_bytes().decode())
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-1] == "[DONE]"


def test_the_generation_routes_are_plain_starlette_routes() -> None:
    """They parse their own bodies; FastAPI's routes would add dependency solving and two exit
    stacks to every request (docs/engine-speed.md, "Per-request costs")."""
    from corral_engine.server import create_app
    from fastapi.routing import APIRoute
    from starlette.routing import Route

    app = create_app(FakeEngine())
    routes = {getattr(r, "path", ""): r for r in app.router.routes}
    for path in ("/v1/completions", "/v1/chat/completions"):
        route = routes[path]
        assert isinstance(route, Route) and not isinstance(route, APIRoute)
        assert route.methods == {"POST"}
