"""Malformed requests get 4xx OpenAI errors; hung-up clients free everything; the server stays healthy."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from corral_engine import wire

from e2e.procs import EngineProcess

pytestmark = [pytest.mark.e2e]

C, H = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def malformed(model: str) -> list[tuple[str, Any, int]]:
    """(path, body (JSON value or raw bytes), expected status): at least 30 kinds of mistakes."""

    def cmpl(**f: Any) -> dict[str, Any]:
        return {"model": model, "prompt": "hi", "max_tokens": 4, **f}

    def chat(**f: Any) -> dict[str, Any]:
        return {"model": model, "messages": USER, "max_tokens": 4, **f}

    return [
        (C, b"{bad json", 400),
        (C, b"", 400),
        (C, b"\xff\xfe\xfa not utf-8 \x80", 400),
        (C, b'{"model": "' + model.encode() + b'", "prompt": "\xc3\x28"}', 400),
        (C, b"[" * 100_000 + b"]" * 100_000, 400),
        (H, b'{"model": "m", "messages": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400),
        (C, ["not", "an", "object"], 400),
        (C, {"prompt": "no model"}, 400),
        (C, cmpl(model="unknown-model"), 404),
        (C, cmpl(model=123), 400),
        (C, cmpl(prompt=[]), 400),
        (C, cmpl(prompt=[[]]), 400),
        (C, cmpl(prompt={"text": "hi"}), 400),
        (C, cmpl(prompt=[1, "mixed"]), 400),
        (C, cmpl(prompt=[-3, 4]), 400),
        (C, cmpl(prompt=[10**9]), 400),
        (C, cmpl(prompt="word " * 2000), 400),  # longer than the context window
        (C, cmpl(max_tokens=-5), 400),
        (C, cmpl(max_tokens=0), 400),
        (C, cmpl(max_tokens=10**15), 400),
        (C, cmpl(max_tokens="ten"), 400),
        (C, cmpl(temperature=-0.5), 400),
        (C, cmpl(temperature=1e9), 400),
        (C, cmpl(top_p=0), 400),
        (C, cmpl(top_k=-7), 400),
        (C, cmpl(min_p=1.5), 400),
        (C, cmpl(presence_penalty=5), 400),
        (C, cmpl(repetition_penalty=-1), 400),
        (C, cmpl(n=0), 400),
        (C, cmpl(n=10**6), 400),
        (C, cmpl(logprobs=10**3), 400),
        (C, cmpl(stop=[""]), 400),
        (C, cmpl(stop={"a": 1}), 400),
        (C, cmpl(seed=2**80), 400),
        (C, cmpl(stream="true"), 400),
        (C, cmpl(stream=True, max_tokens=-1), 400),
        (H, {"model": model}, 400),
        (H, chat(messages=[]), 400),
        (H, chat(messages="hello"), 400),
        (H, chat(messages=[{"role": "alien", "content": "x"}]), 400),
        (H, chat(messages=[{"role": "user"}]), 400),
        (H, chat(messages=[{"role": "user", "content": {"nested": nested(50)}}]), 400),
        (
            H,
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            400,
        ),
        (H, chat(messages=[{"role": "user", "content": "word " * 2000}], max_tokens=None), 400),
        (H, chat(model="gpt-4o"), 404),
        (H, chat(top_logprobs=2), 400),
        (H, chat(max_completion_tokens=-1), 400),
        (H, chat(stream_options={"include_usage": "yes"}, stream=True), 400),
    ]


def kv_state(engine: EngineProcess) -> tuple[float, float, float]:
    return (
        engine.metric(wire.NUM_REQUESTS_RUNNING),
        engine.metric(wire.NUM_REQUESTS_WAITING),
        engine.metric(wire.KV_CACHE_USAGE_PERC),
    )


def wait_until_idle(engine: EngineProcess, timeout_s: float = 10.0) -> tuple[float, float, float]:
    deadline = time.monotonic() + timeout_s
    state = kv_state(engine)
    while state != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
        state = kv_state(engine)
    return state


def test_malformed_requests_get_4xx_openai_errors(engine: EngineProcess) -> None:
    cases = malformed(engine.served_model_name)
    assert len(cases) >= 30
    with httpx.Client(base_url=engine.url, timeout=30) as client:
        for path, body, status in cases:
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = client.post(path, json=body)
            assert r.status_code == status, (path, str(body)[:200], r.status_code, r.text[:300])
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert wire.HEADER_NUM_RUNNING in r.headers
        assert client.get("/health").status_code == 200
        ok = client.post(C, json={"model": engine.served_model_name, "prompt": "still fine", "max_tokens": 3})
        assert ok.status_code == 200
    assert wait_until_idle(engine) == (0, 0, 0)


async def test_fifty_streaming_clients_hanging_up_free_everything(engine: EngineProcess) -> None:
    tokens_before = engine.metric(wire.GENERATION_TOKENS_TOTAL)
    max_tokens = 400
    hung_up = 0

    async def hang_up_mid_stream(i: int) -> None:
        nonlocal hung_up
        body = {
            "model": engine.served_model_name,
            "prompt": f"client {i} says",
            "max_tokens": max_tokens,
            "stream": True,
            "extra": {"ignore": True},
            "ignore_eos": True,
        }
        async with (
            httpx.AsyncClient(base_url=engine.url, timeout=60) as client,
            client.stream("POST", C, json=body) as r,
        ):
            assert r.status_code == 200
            num_chunks = 0
            async for line in r.aiter_lines():
                num_chunks += line.startswith("data: {")
                if num_chunks >= 3:
                    hung_up += 1
                    break  # leaving both blocks closes the connection mid-stream

    async def time_out_non_streaming(i: int) -> None:
        body = {
            "model": engine.served_model_name,
            "prompt": f"slow {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        # Gone long before its answer on any CPU: 400 tokens in 0.1 s would take 250 us a step,
        # a fraction of the step loop's own Python time at this batch size. Only the wait for the
        # answer is that short: 0.1 s to connect, beside 50 streams opening, was a ConnectTimeout
        # on a loaded machine.
        async with httpx.AsyncClient(base_url=engine.url, timeout=httpx.Timeout(60, read=0.1)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(C, json=body)

    await asyncio.gather(
        *(hang_up_mid_stream(i) for i in range(50)), *(time_out_non_streaming(i) for i in range(4))
    )
    assert hung_up == 50
    assert wait_until_idle(engine) == (0, 0, 0)
    # the aborted requests stopped generating: far fewer tokens than 54 full requests
    generated = engine.metric(wire.GENERATION_TOKENS_TOTAL) - tokens_before
    assert generated < 54 * max_tokens / 2
    assert httpx.get(engine.url + "/health").status_code == 200
