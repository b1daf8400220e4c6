"""The official openai client, sync and async, against a real `corral engine`; /metrics as vLLM's."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from corral_engine import wire
from prometheus_client.parser import text_string_to_metric_families

from e2e.procs import EngineProcess

pytestmark = [pytest.mark.e2e]

CHAT: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def sync_client(engine: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def async_client(engine: EngineProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_sync_completions_and_chat(engine: EngineProcess) -> None:
    client = sync_client(engine)
    model = engine.served_model_name
    assert [m.id for m in client.models.list().data] == [model]

    c = client.completions.create(
        model=model, prompt="The fox", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.choices[0].finish_reason == "length" and c.choices[0].text
    assert c.usage is not None and c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0

    r = client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=6, n=3, temperature=1.0, seed=3
    )
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert all(ch.message.role == "assistant" for ch in r.choices)
    assert r.usage is not None and 3 <= r.usage.completion_tokens <= 18


def test_sync_streams_carry_usage_and_join_to_the_full_text(engine: EngineProcess) -> None:
    client = sync_client(engine)
    model = engine.served_model_name
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]

    cstream = client.completions.create(
        model=model, prompt="Once", max_tokens=5, stream=True, stream_options={"include_usage": True}, seed=11
    )
    cchunks = list(cstream)
    assert cchunks[-1].usage is not None and cchunks[-1].usage.completion_tokens <= 5


def test_seed_reproduces_sampling_and_stop_cuts_text(engine: EngineProcess) -> None:
    client = sync_client(engine)
    model = engine.served_model_name

    def sample(seed: int) -> list[str]:
        r = client.completions.create(model=model, prompt="A", max_tokens=16, temperature=1.0, n=2, seed=seed)
        return [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]

    assert sample(5) == sample(5)
    greedy = client.completions.create(
        model=model, prompt="A", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = greedy.choices[0].text
    stop = text[4:6]
    if not stop.strip():
        pytest.skip("the greedy text has no usable stop string")
    cut = client.completions.create(model=model, prompt="A", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


async def test_async_client_many_at_once(engine: EngineProcess) -> None:
    client = async_client(engine)
    model = engine.served_model_name

    async def one_chat(i: int) -> str:
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"number {i}"}], max_tokens=6, temperature=0
        )
        return r.choices[0].message.content or ""

    async def one_stream(i: int) -> int:
        stream = await client.completions.create(
            model=model, prompt=f"item {i}", max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    results = await asyncio.gather(*(one_chat(i) for i in range(6)), *(one_stream(i) for i in range(6)))
    assert all(isinstance(x, str) for x in results[:6])
    assert all(1 <= n <= 6 for n in results[6:])  # type: ignore[operator]
    await client.close()


def test_errors_reach_the_client_as_openai_exceptions(engine: EngineProcess) -> None:
    client = sync_client(engine)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=engine.served_model_name, prompt="x", max_tokens=10**9)
    assert err.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_load_headers_and_metrics(engine: EngineProcess) -> None:
    r = httpx.get(engine.url + "/v1/models")
    for header in (wire.HEADER_NUM_RUNNING, wire.HEADER_NUM_WAITING, wire.HEADER_KV_USAGE):
        assert header in r.headers
    families = {f.name: f for f in text_string_to_metric_families(engine.metrics_text())}
    listed = [
        (wire.NUM_REQUESTS_RUNNING, "gauge"),
        (wire.NUM_REQUESTS_WAITING, "gauge"),
        (wire.KV_CACHE_USAGE_PERC, "gauge"),
        (wire.CACHE_CONFIG_INFO, "gauge"),
        (wire.NUM_PREEMPTIONS_TOTAL, "counter"),
        (wire.PROMPT_TOKENS_TOTAL, "counter"),
        (wire.GENERATION_TOKENS_TOTAL, "counter"),
        (wire.REQUEST_SUCCESS_TOTAL, "counter"),
        (wire.PREFIX_CACHE_QUERIES_TOTAL, "counter"),
        (wire.PREFIX_CACHE_HITS_TOTAL, "counter"),
        (wire.TIME_TO_FIRST_TOKEN_SECONDS, "histogram"),
        (wire.INTER_TOKEN_LATENCY_SECONDS, "histogram"),
        (wire.E2E_REQUEST_LATENCY_SECONDS, "histogram"),
        (wire.REQUEST_QUEUE_TIME_SECONDS, "histogram"),
        (wire.REQUEST_PROMPT_TOKENS, "histogram"),
        (wire.REQUEST_GENERATION_TOKENS, "histogram"),
    ]
    for name, kind in listed:
        family = families[name.removesuffix("_total")]
        assert family.type == kind, name
        assert family.samples, name
        assert all(s.labels.get(wire.MODEL_NAME_LABEL) == engine.served_model_name for s in family.samples)
    info = families[wire.CACHE_CONFIG_INFO].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "512"
    assert engine.metric(wire.GENERATION_TOKENS_TOTAL) > 0
    assert engine.metric(wire.E2E_REQUEST_LATENCY_SECONDS + "_count") > 0


def test_logprobs_through_the_client(engine: EngineProcess) -> None:
    client = sync_client(engine)
    model = engine.served_model_name
    c = client.completions.create(model=model, prompt="The", max_tokens=4, logprobs=3, temperature=0)
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens  # type: ignore[union-attr]
    assert all(x <= 0 for x in lp.token_logprobs)
    r = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2, temperature=0
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)
