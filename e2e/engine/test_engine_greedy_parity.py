"""Greedy text through the HTTP API equals transformers' greedy decode, with many requests in flight."""

from __future__ import annotations

import asyncio
import json
import pathlib
import random

import httpx
import pytest

from e2e.procs import EngineProcess

pytestmark = [pytest.mark.e2e]

NUM_PROMPTS = 16
MAX_NEW_TOKENS = 24


def reference_texts(model_dir: pathlib.Path, prompts: list[list[int]]) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0
            )
            texts.append(str(tokenizer.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True)))
    return texts


async def test_greedy_text_matches_transformers(engine: EngineProcess, tiny_model_dir: pathlib.Path) -> None:
    rng = random.Random(0)
    # Token-id prompts of varied lengths (some sharing a prefix, so prefix caching is exercised).
    shared = [1] + [rng.randrange(3, 1024) for _ in range(40)]
    prompts = [
        [1] + [rng.randrange(3, 1024) for _ in range(rng.randrange(1, 60))] for _ in range(NUM_PROMPTS // 2)
    ]
    prompts += [shared + [rng.randrange(3, 1024) for _ in range(i + 1)] for i in range(NUM_PROMPTS // 2)]

    async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:

        async def complete(prompt: list[int]) -> str:
            body = {
                "model": engine.served_model_name,
                "prompt": prompt,
                "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
            }
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        async def stream_pair(prompt: list[int]) -> str:
            # the same prompt sent as one batch entry of a multi-prompt streaming request
            body = {
                "model": engine.served_model_name,
                "prompt": [prompt, prompt],
                "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
                "stream": True,
            }
            pieces: dict[int, list[str]] = {0: [], 1: []}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            pieces[choice["index"]].append(choice["text"])
            assert "".join(pieces[0]) == "".join(pieces[1])
            return "".join(pieces[0])

        got = await asyncio.gather(*(complete(p) for p in prompts), *(stream_pair(p) for p in prompts[:4]))

    expected = reference_texts(tiny_model_dir, prompts)
    assert sum(len(t) for t in expected) > NUM_PROMPTS  # the comparison is not between empty strings
    assert got[:NUM_PROMPTS] == expected
    assert got[NUM_PROMPTS:] == expected[:4]
