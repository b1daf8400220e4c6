"""Every client mistake is a 4xx OpenAI error from the one error module, and nothing leaks."""

from __future__ import annotations

import asyncio
import pathlib
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from corral_engine import wire
from corral_engine.server import create_app

from tests.server.fake_engine import VOCAB, FakeEngine

MODEL = FakeEngine.served_model_name
USER = [{"role": "user", "content": "hi"}]


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


C, H = "/v1/completions", "/v1/chat/completions"
REFUSAL = {"type": "refusal", "refusal": "no"}
NESTED_30: Any = 1
for _ in range(30):
    NESTED_30 = [NESTED_30]

# (path, body as JSON-able value or raw bytes, expected status, expected param or None)
BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    (C, b"{not json", 400, None),
    (C, b"", 400, None),
    (C, b"\xff\xfe\x00garbage", 400, None),
    (C, b'{"model": "fake-model", "prompt": "\xc3\x28"}', 400, None),
    (C, b"[" * 5000 + b"]" * 5000, 400, None),
    (C, {"model": MODEL, "prompt": "x", "extra": NESTED_30}, 200, None),
    (C, [1, 2, 3], 400, None),
    (C, "just a string", 400, None),
    (C, {"prompt": "hi"}, 400, "model"),
    (C, cmpl(model="nope"), 404, "model"),
    (C, cmpl(model=7), 400, "model"),
    (C, cmpl(prompt=None), 400, "prompt"),
    (C, cmpl(prompt=[]), 400, None),
    (C, cmpl(prompt=[[]]), 400, None),
    (C, cmpl(prompt=[1, "a"]), 400, "prompt"),
    (C, cmpl(prompt=[-1, 5]), 400, "prompt"),
    (C, cmpl(prompt=[999999]), 400, "prompt"),
    (C, cmpl(prompt="", max_tokens=4), 200, None),  # the fake adds BOS, so it is not empty
    (C, cmpl(max_tokens=-1), 400, "max_tokens"),
    (C, cmpl(max_tokens=0), 400, "max_tokens"),
    (C, cmpl(max_tokens=10**12), 400, "max_tokens"),
    (C, cmpl(max_tokens="5"), 400, "max_tokens"),
    (C, cmpl(max_tokens=2.5), 400, "max_tokens"),
    (C, cmpl(temperature=-1), 400, "temperature"),
    (C, cmpl(temperature="hot"), 400, "temperature"),
    (C, cmpl(top_p=0), 400, "top_p"),
    (C, cmpl(top_p=1.5), 400, "top_p"),
    (C, cmpl(top_k=-5), 400, "top_k"),
    (C, cmpl(min_p=2), 400, "min_p"),
    (C, cmpl(presence_penalty=9), 400, "presence_penalty"),
    (C, cmpl(frequency_penalty=-9), 400, "frequency_penalty"),
    (C, cmpl(repetition_penalty=0), 400, "repetition_penalty"),
    (C, cmpl(n=0), 400, "n"),
    (C, cmpl(n=1000), 400, "n"),
    (C, cmpl(n=True), 400, "n"),
    (C, cmpl(logprobs=99), 400, "logprobs"),
    (C, cmpl(stop=[""]), 400, "stop"),
    (C, cmpl(stop=["a"] * 40), 400, None),
    (C, cmpl(stop=5), 400, "stop"),
    (C, cmpl(seed="x"), 400, "seed"),
    (C, cmpl(seed=2**70), 400, "seed"),
    (C, cmpl(stream="yes"), 400, "stream"),
    (C, cmpl(stream_options={"include_usage": "y"}), 400, "stream_options.include_usage"),
    (C, cmpl(echo=True, logprobs=1, stream=True), 400, "stream"),
    (C, cmpl(suffix="x"), 400, "suffix"),
    (C, cmpl(best_of=1, n=2), 400, "best_of"),
    (C, cmpl(logit_bias={"x": 1}), 400, "logit_bias"),
    (C, cmpl(logit_bias={"²": 1}), 400, "logit_bias"),  # a digit to str.isdigit, not to int()
    (H, {"model": MODEL}, 400, "messages"),
    (H, chat(messages=[]), 400, "messages"),
    (H, chat(messages="hi"), 400, "messages"),
    (H, chat(messages=[{"content": "hi"}]), 400, "messages.0.role"),
    (H, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    (H, chat(messages=[{"role": "user"}]), 400, "messages.0"),
    (H, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    (H, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400, None),
    (H, chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]), 400, "messages.0.content"),
    (H, chat(messages=[{"role": "user", "content": [REFUSAL]}]), 400, "messages.0"),
    (H, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0"),  # no tool_call_id
    (H, chat(messages=[{"role": "tool", "tool_call_id": "c1", "content": "x"}]), 400, "messages"),  # template
    (H, chat(stream_options={"include_usage": True}), 400, "stream_options"),  # without stream
    (C, cmpl(stream_options={"include_usage": True}, stream=False), 400, "stream_options"),
    (C, cmpl(prompt="a" * 4000), 400, "prompt"),  # refused untokenized: at least 333 tokens > 256
    (C, cmpl(prompt=["hi", "a" * 4000]), 400, "prompt.1"),
    (H, chat(model="gpt-4"), 404, "model"),
    (H, chat(max_completion_tokens=0), 400, "max_tokens"),
    (H, chat(top_logprobs=3), 400, None),
    (H, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (H, chat(messages=[{"role": "user", "content": "x" * 400}], max_tokens=None), 400, "messages"),
    (H, chat(messages=[{"role": "user", "content": "x" * 200}], max_tokens=100), 400, "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_request_gets_openai_error(
    client: httpx.AsyncClient, engine: FakeEngine, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    assert wire.HEADER_NUM_WAITING in r.headers
    if status != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        if param is not None:
            assert error["param"] == param
    assert engine.requests == {}
    assert (await client.get("/health")).status_code == 200


async def test_unknown_route_and_method_are_json_errors(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = await client.post("/v1/audio/transcriptions", json={"model": "m"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "This server has no route POST /v1/audio/transcriptions."
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_a_429_counts_the_requests_it_was_refused_behind(tiny_model_dir: pathlib.Path) -> None:
    """The load headers are the last step's, but a queue-full 429 reports the queue it was refused
    on: requests handed to the step loop since that step count beyond the batch's one seat (the
    step's count reads 0)."""
    from corral_engine import AsyncEngine, EngineArgs, SamplingParams

    args = EngineArgs(
        model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=1, max_waiting=2
    )
    engine = AsyncEngine(args)
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def held_step() -> Any:  # the step loop stays in its step, taking no new request in
        in_step.set()
        release.wait(30.0)
        return real_step()

    engine.engine.step = held_step  # type: ignore[method-assign]
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        streams = [engine.add_request("running", [1, 2, 3], params)]
        assert await asyncio.to_thread(in_step.wait, 30.0)
        streams += [engine.add_request(f"queued-{i}", [1, 2, 3], params) for i in range(2)]
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                body = {"model": engine.served_model_name, "prompt": [1, 2], "max_tokens": 2}
                r = await client.post(C, json=body)
            assert r.status_code == 429 and engine.stats().num_waiting == 0
        finally:
            release.set()
        assert r.headers[wire.HEADER_NUM_WAITING] == "2"
        for stream in streams:
            async for _ in stream:
                pass


async def test_queue_full_is_429_with_retry_after_and_a_requests_prompts_get_in_together() -> None:
    engine = FakeEngine(max_waiting=2)
    engine.gate.clear()
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            # three prompts against a limit of two, into an empty queue: admitted as one request
            # (refusing them would refuse the request for ever, however idle the engine)
            first = asyncio.create_task(client.post(C, json=cmpl(prompt=["a", "b", "c"])))
            while len(engine.requests) < 3:
                await asyncio.sleep(0.001)
            r = await client.post(C, json=cmpl())
            assert r.status_code == 429
            assert r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert len(engine.requests) == 3 and engine.aborted == []
            metrics = (await client.get("/metrics")).text
            assert (
                f'{wire.NUM_REQUESTS_REJECTED_TOTAL}{{model_name="{MODEL}",reason="queue_full"}} 1.0'
                in metrics
            )
            engine.gate.set()
            r = await first
            assert r.status_code == 200 and len(r.json()["choices"]) == 3


async def test_a_refused_prompt_aborts_the_requests_others() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            r = await client.post(C, json=cmpl(prompt=[[97, 98], [97, VOCAB + 5]]))
            assert r.status_code == 400
            assert engine.requests == {} and len(engine.aborted) == 1


async def test_dead_engine_is_503(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.is_dead = True
    r = await client.post(C, json=cmpl())
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert (await client.get("/health")).status_code == 503


async def test_api_key_is_required_on_v1_only() -> None:
    app = create_app(FakeEngine(), api_key="s3cret")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            r = await client.post(C, json=cmpl())
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert wire.HEADER_KV_USAGE in r.headers
            r = await client.post(C, json=cmpl(), headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200


async def test_refusals_are_counted_by_reason(client: httpx.AsyncClient) -> None:
    await client.post(C, json=cmpl(max_tokens=0))
    await client.post(C, content=b"{", headers={"content-type": "application/json"})
    await client.post(H, json=chat(model="other"))
    await client.get("/v1/models/other")  # a read, not a refused request
    metrics = (await client.get("/metrics")).text
    name = wire.NUM_REQUESTS_REJECTED_TOTAL
    assert f'{name}{{model_name="{MODEL}",reason="invalid"}} 2.0' in metrics
    assert f'{name}{{model_name="{MODEL}",reason="unknown_model"}} 1.0' in metrics
    assert f'{name}{{model_name="{MODEL}",reason="queue_full"}} 0.0' in metrics


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {}}, {"type": "file", "file": {}}])
async def test_a_non_text_part_is_named(client: httpx.AsyncClient, part: dict[str, Any]) -> None:
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, part]}])
    r = await client.post(H, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages.0.content"
    assert f"content part 1 is of type {part['type']!r}" in error["message"]
    assert "text parts, image_url parts" in error["message"] and "Value error" not in error["message"]


async def test_an_image_part_to_a_text_only_model_is_named(client: httpx.AsyncClient) -> None:
    part = {"type": "image_url", "image_url": {"url": "data:,"}}
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, part]}])
    r = await client.post(H, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url"
    assert "a text-only model" in error["message"]


async def test_an_assistant_refusal_part_is_history(client: httpx.AsyncClient) -> None:
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "user", "content": [{"type": "text", "text": "ok"}]},
    ]
    r = await client.post(H, json=chat(messages=history))
    assert r.status_code == 200, r.text


def _on_encode(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, note: Callable[[str], None]) -> None:
    """Call `note(text)` each time the engine's tokenizer encodes a text."""
    encode = engine.tokenizer.encode

    def recording(text: str, **kw: Any) -> list[int]:
        note(text)
        return encode(text, **kw)

    monkeypatch.setattr(engine.tokenizer, "encode", recording)


async def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(
    client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[int] = []
    _on_encode(engine, monkeypatch, lambda text: encoded.append(len(text)))
    r = await client.post(C, json=cmpl(prompt="a" * 100_000))
    assert r.status_code == 400 and encoded == []
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    # unless it is to be truncated: then it is tokenized (long, so off the event loop) and cut
    r = await client.post(C, json=cmpl(prompt="a" * 100_000, truncate_prompt_tokens=8))
    assert r.status_code == 200 and encoded == [100_000]
    assert r.json()["usage"]["prompt_tokens"] == 8


def _tool(description: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "description": description}}


async def test_long_prompts_are_tokenized_off_the_event_loop(
    client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    _on_encode(engine, monkeypatch, lambda _text: threads.append(threading.current_thread().name))
    long_text = "a " * 2500  # 5,000 characters: past OFF_LOOP_CHARS, within the length bound
    for path, body in (
        (C, cmpl(prompt="short")),
        (C, cmpl(prompt=long_text, truncate_prompt_tokens=8)),
        (H, chat(messages=[{"role": "user", "content": long_text}], truncate_prompt_tokens=8)),
        (H, chat(tools=[_tool(long_text)], tool_choice="none", truncate_prompt_tokens=8)),  # agents
    ):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
    main = threading.current_thread().name
    assert threads[0] == main
    assert all(name.startswith("corral-tokenize") for name in threads[1:]), threads


async def test_browsers_may_call_it_from_any_origin_and_preflights_need_no_key() -> None:
    app = create_app(FakeEngine(), api_key="s3cret")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            origin = {"Origin": "http://127.0.0.1:3000"}
            preflight = {
                **origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            r = await client.options(H, headers=preflight)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
            r = await client.post(C, json=cmpl(), headers={**origin, "Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
            r = await client.post(C, json=cmpl(), headers=origin)  # the key is still required
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
