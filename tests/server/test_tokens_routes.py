"""vLLM's /tokenize, /detokenize and /version on the engine server (fake engine: bytes are tokens)."""

from __future__ import annotations

import httpx

from tests.server.fake_engine import BOS, FakeEngine

MODEL = FakeEngine.served_model_name


async def test_tokenize_prompts_and_conversations_as_generation_would(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 3,
        "max_model_len": 256,
        "tokens": [BOS, ord("h"), ord("i")],
        "token_strs": ["", "h", "i"],
    }
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "hi", "add_special_tokens": False})
    assert r.json()["tokens"] == [ord("h"), ord("i")] and r.json()["token_strs"] is None
    chat = {"messages": [{"role": "user", "content": "yo"}]}
    r = await client.post("/tokenize", json=chat)
    assert bytes(r.json()["tokens"]).decode() == "<user>yo\n<assistant>"
    count = r.json()["count"]
    r = await client.post("/tokenize", json={**chat, "add_generation_prompt": False})
    assert bytes(r.json()["tokens"]).decode() == "<user>yo\n"
    same = await client.post("/v1/chat/completions", json={"model": MODEL, **chat, "max_tokens": 1})
    assert same.json()["usage"]["prompt_tokens"] == count


async def test_detokenize_version_and_errors(client: httpx.AsyncClient) -> None:
    r = await client.post("/detokenize", json={"tokens": [ord("o"), ord("k")]})
    assert r.status_code == 200 and r.json() == {"prompt": "ok"}
    r = await client.get("/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)
    for path, body, status in [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404),
        ("/tokenize", {"prompt": ["a", "b"]}, 400),
        ("/tokenize", [1, 2], 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": [ord("o"), 100_000]}, 400),  # past the vocabulary: not dropped
        ("/detokenize", {"tokens": "abc"}, 400),
    ]:
        r = await client.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        assert "error" in r.json()
