"""The engine server with the output overlap on (CORRAL_OVERLAP_OUTPUT=1, the default on CUDA):
completions, streamed or not, with stop strings, n > 1 and logprobs, are the same as without it."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import openai
import pytest
from corral_engine.settings import EngineSettings

from tests.server.real_engine import openai_client

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"


async def _completions(client: openai.AsyncOpenAI, stop: str) -> list[Any]:
    """Greedy with a stop string, streamed and not; sampled n=2 with logprobs."""
    greedy: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    whole = await client.completions.create(**greedy, stop=[stop])
    stream = await client.completions.create(**greedy, stop=[stop], stream=True)
    pieces, reasons = [], []
    async for chunk in stream:
        pieces += [c.text for c in chunk.choices]
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert "".join(pieces) == whole.choices[0].text and reasons == [whole.choices[0].finish_reason]
    sampled = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=3, logprobs=1, extra_body={"ignore_eos": True}
    )
    lp = [c.logprobs.tokens if c.logprobs else None for c in sampled.choices]
    return [whole.choices[0].text, whole.choices[0].finish_reason, [c.text for c in sampled.choices], lp]


async def _stop_string(client: openai.AsyncOpenAI) -> str:
    """Three letters the greedy completion reaches after its first 8 characters."""
    free = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    match = re.search(r"[A-Za-z]{3}", free.choices[0].text[8:])
    assert match is not None
    return match.group()


async def test_completions_match_without_the_overlap(tiny_model_dir: pathlib.Path) -> None:
    async with openai_client(tiny_model_dir, settings=EngineSettings(overlap_output="0")) as client:
        stop = await _stop_string(client)
        plain = await _completions(client, stop)
    async with openai_client(tiny_model_dir, settings=EngineSettings(overlap_output="1")) as client:
        assert await _completions(client, stop) == plain
    assert plain[1] == "stop" and stop not in plain[0]


async def test_completions_match_with_async_scheduling(tiny_model_dir: pathlib.Path) -> None:
    """CORRAL_ASYNC_SCHEDULING=1: the greedy requests run ahead, the sampled one with logprobs
    waits each step; both as without it."""
    async with openai_client(tiny_model_dir, settings=EngineSettings(async_scheduling="0")) as client:
        stop = await _stop_string(client)
        plain = await _completions(client, stop)
    async with openai_client(tiny_model_dir, settings=EngineSettings(async_scheduling="1")) as client:
        assert await _completions(client, stop) == plain


async def test_completions_match_with_the_engine_core_apart(tiny_model_dir: pathlib.Path) -> None:
    """CORRAL_ENGINE_PROCESS=1: the same completions, a 400 for a prompt over the context and for a
    schema that does not compile, constrained output, and the engine's gauges on /metrics."""
    async with openai_client(tiny_model_dir, settings=EngineSettings(engine_process="0")) as client:
        stop = await _stop_string(client)
        plain = await _completions(client, stop)
    async with openai_client(tiny_model_dir, settings=EngineSettings(engine_process="1")) as client:
        assert await _completions(client, stop) == plain
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt=[1] * 4096, max_tokens=4)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"structured_outputs": {"regex": "(x"}}
            )
        choice = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        assert choice.choices[0].text in ("yes", "no")
        metrics = (await client._client.get("http://127.0.0.1/metrics")).text
        assert 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0' in metrics
        assert re.search(r'vllm:generation_tokens_total\{engine="0",model_name="tiny-llama"\} [1-9]', metrics)
        assert re.search(r"corral_engine_step_duration_seconds_count\{[^}]*\} [1-9]", metrics)
