"""A chat completion served by the real engine from a mixture-of-experts demo checkpoint."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import pytest

from tests.server.real_engine import openai_client


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
async def test_a_moe_model_answers_a_chat_completion(
    tiny_model_dirs: Mapping[str, pathlib.Path], arch: str
) -> None:
    model_dir = tiny_model_dirs[arch]
    async with openai_client(model_dir) as client:
        models = await client.models.list()
        reply = await client.chat.completions.create(
            model=models.data[0].id,
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=6,
            temperature=0.0,
        )
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)
