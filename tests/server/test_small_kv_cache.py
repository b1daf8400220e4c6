"""The engine server over a KV cache smaller than the context (the engine warns and serves): the
requests that fit the cache are served, and those that cannot are refused naming the reason."""

from __future__ import annotations

import pathlib

import openai
import pytest

from tests.server.real_engine import openai_client

MODEL = "tiny-llama"
KV_BLOCKS, BLOCK_SIZE = 8, 16  # 128 tokens of KV; the tiny model's context is 512


async def test_chat_without_max_tokens_fills_the_cache_not_the_context(tiny_model_dir: pathlib.Path) -> None:
    async with openai_client(tiny_model_dir, num_kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hey"}], extra_body={"ignore_eos": True}
        )
    assert reply.usage is not None and reply.usage.total_tokens == KV_BLOCKS * BLOCK_SIZE
    assert reply.choices[0].finish_reason == "length"


async def test_a_prompt_the_cache_cannot_hold_is_refused(tiny_model_dir: pathlib.Path) -> None:
    async with openai_client(tiny_model_dir, num_kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL, prompt=list(range(3, 203)), max_tokens=1)
        assert refused.value.body["param"] == "prompt"  # type: ignore[index]
        assert "the prompt has 200 tokens" in refused.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL, prompt=list(range(3, 103)), max_tokens=50)
        assert refused.value.body["param"] == "max_tokens"  # type: ignore[index]
