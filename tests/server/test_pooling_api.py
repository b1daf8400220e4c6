"""POST /pooling (vLLM's generic pooling API) with `task` embed or classify: the same outputs as
/v1/embeddings and /classify, in vLLM's pooling shape; `task` required (vLLM's default is a
per-token output this engine does not compute), and the other refusals OpenAI-shaped."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

from tests.server.real_engine import assert_invalid_request, http_client

MODEL = "pooler"
TEXTS = ["the quick brown fox", "paris is the capital of france"]


def _data(body: dict[str, Any], num_inputs: int) -> list[Any]:
    assert body["object"] == "list" and body["id"].startswith("pool-") and body["model"] == MODEL
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "pooling") for i in range(num_inputs)]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    return [d["data"] for d in body["data"]]


async def test_task_embed_gives_the_embeddings(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    async with http_client(demo_encoders["bert"], max_model_len=64, served_model_name=MODEL) as http:
        want = await http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS, "normalize": False})
        got = await http.post(
            "/pooling", json={"model": MODEL, "input": TEXTS, "task": "embed", "normalize": False}
        )
        assert got.status_code == 200, got.text
        assert _data(got.json(), 2) == [d["embedding"] for d in want.json()["data"]]
        missing = await http.post("/pooling", json={"model": MODEL, "input": TEXTS})
        assert_invalid_request(missing, 400, "task", "task is required")
        other = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "classify"})
        assert_invalid_request(other, 400, "task", "pools for task 'embed'")
        cut = {"model": MODEL, "input": "a", "task": "embed", "dimensions": 8}
        dims = await http.post("/pooling", json=cut)
        assert_invalid_request(dims, 400, "dimensions", "not supported")


async def test_task_classify_gives_the_probabilities(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    model_dir = demo_encoders["bert-classifier"]
    async with http_client(model_dir, max_model_len=64, served_model_name=MODEL) as http:
        want = await http.post("/classify", json={"model": MODEL, "input": TEXTS})
        got = await http.post("/pooling", json={"model": MODEL, "input": TEXTS, "task": "classify"})
        assert got.status_code == 200, got.text
        assert _data(got.json(), 2) == [d["probs"] for d in want.json()["data"]]


async def test_a_generating_engine_refuses_pooling(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    async with http_client(tiny_model_dirs["llama"], num_kv_blocks=64, served_model_name=MODEL) as http:
        resp = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "embed"})
        assert_invalid_request(resp, 400, "model", "text generation")
