"""Every POST a backend serves goes through the gateway to the body's model, with the same routing,
retries and auth: /v1/embeddings, /v1/responses, multipart /v1/audio/*, vLLM's /tokenize."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import dead_url, fleet


async def test_other_openai_and_vllm_paths_reach_the_models_replicas() -> None:
    engine = FakeEngine(name="a")
    async with fleet([engine]) as (client, _):
        for path, body in [
            ("/v1/embeddings", {"model": "m", "input": "hello"}),
            ("/v1/responses", {"model": "m", "input": "hello"}),
            ("/tokenize", {"model": "m", "prompt": "hello"}),
            ("/tokenize", {"prompt": "no model: the only model's replicas"}),
        ]:
            r = await client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            assert r.json()["path"] == path and r.json()["replica"] == "a"
        form = {"model": "m", "language": "en"}
        audio = bytes(range(256)) * 64
        r = await client.post(
            "/v1/audio/transcriptions", data=form, files={"file": ("a.wav", audio, "audio/wav")}
        )
        assert r.status_code == 200 and r.json()["path"] == "/v1/audio/transcriptions"
        assert r.json()["content_type"].startswith("multipart/form-data; boundary=")
        assert audio in engine.bodies[-1]  # the bytes as sent
        r = await client.post("/v1/embeddings", json={"model": "other", "input": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        form_other = await client.post(
            "/v1/audio/translations", data={"model": "other"}, files={"file": ("a", b"x")}
        )
        assert form_other.status_code == 404
        assert (await client.get("/v1/embeddings")).status_code == 404  # only POSTs are forwarded
        assert (await client.get("/v1/completions")).status_code == 405
        models = await client.get("/v1/models")
        assert [m["id"] for m in models.json()["data"]] == ["m"]


async def test_other_paths_fail_over_like_completions() -> None:
    engine = FakeEngine(name="good")
    async with fleet([engine], extra_urls=[dead_url()], max_attempts=3) as (client, _):
        for _ in range(4):
            r = await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
            assert r.status_code == 200 and r.json()["replica"] == "good"


async def test_dot_segments_never_reach_a_replica_route_outside_v1() -> None:
    engine = FakeEngine(name="a")
    async with fleet([engine]) as (client, _):
        base = str(client.base_url).rstrip("/")
        for escape in [
            "/v1/%2e%2e/tokenize",
            "/v1/.%2e/tokenize",
            "/v1/%252e%252e/tokenize",
            "/v1/x/%2e%2e/%2e%2e/tokenize",
        ]:
            url = httpx.URL(base + escape)
            r = await client.post(url, json={"model": "m", "prompt": "hi"})
            assert r.status_code == 404, (escape, r.text)
        assert engine.bodies == []
        r = await client.post("/v1/audio/speech.v2", json={"model": "m"})  # dots inside a name are fine
        assert r.status_code == 200 and r.json()["path"] == "/v1/audio/speech.v2"


async def test_score_and_rerank_paths_reach_the_models_replicas() -> None:
    """vLLM's score and rerank routes, Cohere's /v2/rerank among them, go to the body's model."""
    engine = FakeEngine(name="a")
    async with fleet([engine]) as (client, _):
        for path in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"):
            r = await client.post(path, json={"model": "m", "query": "q", "documents": ["d"]})
            assert r.status_code == 200, (path, r.text)
            assert r.json()["path"] == path and r.json()["replica"] == "a"
        assert (await client.post("/v2/other", json={"model": "m"})).status_code == 404
