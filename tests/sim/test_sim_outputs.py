"""A simulated replica's outputs have the engine's shapes where clients parse them: greedy siblings
are equal, logprobs and prompt_logprobs are synthetic but well-formed (the token and its top-k
alternatives, descending), and /tokenize names special tokens as the engine does."""

from __future__ import annotations

import itertools
import math
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from corral_engine.server import create_app
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import Fitted, Profile

PROFILE = Profile("test", Fitted((1e-4, 0.0, 0.0, 0.0, 0.0)), num_kv_blocks=256, max_model_len=256)


@pytest.fixture
async def client(tiny_model_dir: pathlib.Path) -> AsyncIterator[httpx.AsyncClient]:
    [engine] = build_engines(ReplicaSpec(PROFILE, tiny_model_dir, "sim"), 1)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            yield c


async def _complete(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    body = {"model": "sim", "prompt": "one two three four five", "max_tokens": 6, **fields}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_greedy_siblings_are_equal_and_sampled_ones_differ(client: httpx.AsyncClient) -> None:
    greedy = await _complete(client, n=2, temperature=0)
    texts = [c["text"] for c in greedy["choices"]]
    assert texts[0] and texts[0] == texts[1]
    sampled = await _complete(client, n=2, temperature=1.0)
    assert sampled["choices"][0]["text"] != sampled["choices"][1]["text"]
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3}
    r = await client.post("/v1/chat/completions", json={**chat, "temperature": 0})
    assert len({c["message"]["content"] for c in r.json()["choices"]}) == 1
    regex = {"structured_outputs": {"regex": "[0-9]{5}"}, "temperature": 0}
    r = await client.post("/v1/chat/completions", json={**chat, **regex, "max_tokens": 10})
    assert len({c["message"]["content"] for c in r.json()["choices"]}) == 1  # constrained too


def _check_descending(alternatives: list[float], k: int) -> None:
    assert len(alternatives) == k and alternatives[0] < 0
    assert all(a > b for a, b in itertools.pairwise(alternatives))
    assert sum(math.exp(a) for a in alternatives) < 1


def _check_rank(rank: int, logprob: float, top: list[tuple[Any, float]], token: Any) -> None:
    """The token sits at its rank in the top k, or below the last of them when it ranks lower."""
    if rank <= len(top):
        assert top[rank - 1] == (token, logprob), (rank, top)
    else:
        assert token not in [t for t, _ in top] and logprob < top[-1][1]


async def test_logprobs_hold_the_token_and_its_top_alternatives(client: httpx.AsyncClient) -> None:
    out = await _complete(client, logprobs=2, temperature=0)
    logprobs = out["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
    items = zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    for token, logprob, top in items:
        assert next(iter(top)) == token and top[token] == logprob  # greedy: the likeliest, as argmax
        _check_descending(list(top.values()), 2)
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
    body = {**chat, "logprobs": True, "top_logprobs": 3, "temperature": 0}
    content = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"][
        "content"
    ]
    assert len(content) == 4
    for item in content:
        assert item["top_logprobs"][0]["token"] == item["token"]
        _check_descending([t["logprob"] for t in item["top_logprobs"]], 3)


async def test_sampled_tokens_are_not_always_the_likeliest(client: httpx.AsyncClient) -> None:
    # A real engine samples lower-ranked tokens at temperature > 0; their rank and place in the
    # top k stay consistent (the chat format shows the top k, and the token's own logprob apart).
    prompt = " ".join(f"w{i}" for i in range(40))
    chat = {"model": "sim", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64}
    body = {**chat, "logprobs": True, "top_logprobs": 3, "temperature": 1.0, "seed": 7}
    content = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"][
        "content"
    ]
    ranks = []
    for item in content:
        top = [(t["token"], t["logprob"]) for t in item["top_logprobs"]]
        _check_descending([lp for _, lp in top], 3)
        rank = next(
            (r for r, (t, lp) in enumerate(top, 1) if (t, lp) == (item["token"], item["logprob"])), None
        )
        assert rank is not None or item["logprob"] < top[-1][1]
        ranks.append(rank or 4)
    assert ranks.count(1) > len(ranks) / 2 and any(r > 1 for r in ranks)
    again = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"]["content"]
    assert again == content  # repeatable


async def test_prompt_logprobs_score_every_prompt_token_after_the_first(client: httpx.AsyncClient) -> None:
    text = " ".join(f"w{i}" for i in range(40))
    r = await client.post("/tokenize", json={"prompt": text})
    prompt = r.json()["tokens"]
    out = await _complete(client, prompt=text, prompt_logprobs=2, max_tokens=2)
    scored = out["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    ranks = []
    for token_id, entry in zip(prompt[1:], scored[1:], strict=True):
        own = entry[str(token_id)]
        top = sorted(((k, e["logprob"]) for k, e in entry.items() if e["rank"] <= 2), key=lambda kv: -kv[1])
        _check_descending([lp for _, lp in top], 2)
        _check_rank(own["rank"], own["logprob"], top, str(token_id))
        ranks.append(own["rank"])
    assert 1 in ranks and any(r > 1 for r in ranks)  # prompt text is not all the model's argmax


async def test_tokenize_names_bos_as_the_engine_does(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    strs = r.json()["token_strs"]
    assert strs[0] == "<s>" and all(strs)
    r = await client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.json()["prompt"].startswith("<s>")
