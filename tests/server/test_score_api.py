"""POST /v1/score and /v1/rerank (and vLLM's /score, /rerank, /v2/rerank) on a real cross-encoder
engine, through httpx (the openai client has no such calls): 1:1, 1:N and N:N pairs scored as
transformers scores them, rerank's order, top_n and return_documents, the engine core in its own
process; OpenAI-shaped errors; the routes refused on embedding and generating engines, and the
embeddings and generation routes on a reranker."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
import torch

from tests.server.real_engine import assert_invalid_request, http_client

MODEL = "reranker"
TOLERANCE = 2e-5
QUERY = "what is the capital of france"
DOCS = [
    "the quick brown fox jumps over the lazy dog",
    "paris is the capital of france",
    "a",
    "berlin is well known for its museums and its long history",
]


def serve(
    model_dir: pathlib.Path, in_own_process: bool = False, **args: Any
) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
    args.setdefault("served_model_name", MODEL)
    return http_client(model_dir, in_own_process, max_model_len=64, **args)


def _reference(
    model_dir: pathlib.Path, pairs: list[tuple[str, str]], is_activated: bool = True
) -> list[float]:
    """transformers' score of each pair: its logit's sigmoid, or the logit itself."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = [model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0] for a, b in pairs]
    return [float(torch.sigmoid(x) if is_activated else x) for x in logits]


def _scores(body: dict[str, Any]) -> list[float]:
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "score" for d in body["data"])
    return [d["score"] for d in body["data"]]


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
async def test_score_pairs_one_to_one_one_to_many_and_many_to_many(
    demo_encoders: Mapping[str, pathlib.Path], arch: str
) -> None:
    model_dir = demo_encoders[f"{arch}-reranker"]
    expected = _reference(model_dir, [(QUERY, d) for d in DOCS])
    async with serve(model_dir) as http:
        one = await http.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS[1]})
        assert one.status_code == 200, one.text
        assert _scores(one.json()) == pytest.approx([expected[1]], abs=TOLERANCE)
        assert one.json()["model"] == MODEL and one.json()["usage"]["prompt_tokens"] > 0
        many = await http.post("/score", json={"model": MODEL, "text_1": [QUERY], "text_2": DOCS})
        assert many.status_code == 200, many.text
        assert _scores(many.json()) == pytest.approx(expected, abs=TOLERANCE)
        firsts = [QUERY, "b", QUERY, "c"]
        n_to_n = await http.post("/v1/score", json={"model": MODEL, "text_1": firsts, "text_2": DOCS})
        assert n_to_n.status_code == 200, n_to_n.text
        assert _scores(n_to_n.json()) == pytest.approx(
            _reference(model_dir, list(zip(firsts, DOCS, strict=True))), abs=TOLERANCE
        )


async def test_rerank_orders_by_relevance_with_top_n_and_documents(
    demo_encoders: Mapping[str, pathlib.Path],
) -> None:
    model_dir = demo_encoders["bert-reranker"]
    expected = _reference(model_dir, [(QUERY, d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    async with serve(model_dir) as http:
        resp = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["id"].startswith("rerank-") and body["model"] == MODEL
        assert body["usage"]["total_tokens"] > 0
        assert [r["index"] for r in body["results"]] == order
        for r in body["results"]:
            assert r["document"] == {"text": DOCS[r["index"]]}
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=TOLERANCE)
        for path in ("/rerank", "/v2/rerank"):
            top = await http.post(
                path,
                json={
                    "model": MODEL,
                    "query": QUERY,
                    "documents": DOCS,
                    "top_n": 2,
                    "return_documents": False,
                },
            )
            assert top.status_code == 200, top.text
            assert [r["index"] for r in top.json()["results"]] == order[:2]
            assert all("document" not in r for r in top.json()["results"])


async def test_the_engine_core_in_its_own_process_scores(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    model_dir = demo_encoders["bert-reranker"]
    expected = _reference(model_dir, [(QUERY, d) for d in DOCS])
    async with serve(model_dir, in_own_process=True) as http:
        resp = await http.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS})
        assert resp.status_code == 200, resp.text
        assert _scores(resp.json()) == pytest.approx(expected, abs=TOLERANCE)


async def test_errors_are_openai_shaped(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    long_text = " ".join(["capital"] * 80)
    async with serve(demo_encoders["bert-reranker"]) as http:
        empty = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": []})
        assert_invalid_request(empty, 400, "documents", "At least one text_pair element")
        uneven = await http.post("/v1/score", json={"model": MODEL, "text_1": ["a", "b"], "text_2": DOCS})
        assert_invalid_request(uneven, 400, "text_1", "1:1, 1:N or N:N")
        too_long = await http.post(
            "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a", long_text]}
        )
        assert_invalid_request(too_long, 400, "documents.1", "maximum context length is 64 tokens")
        cut = await http.post(
            "/v1/rerank",
            json={
                "model": MODEL,
                "query": QUERY,
                "documents": ["a", long_text],
                "truncate_prompt_tokens": -1,
            },
        )
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["total_tokens"] <= 2 * 64  # the long pair cut to the context
        embed = await http.post("/v1/embeddings", json={"model": MODEL, "input": "hello"})
        assert_invalid_request(embed, 400, "model", "cross-encoder")
        chat = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hello"})
        assert_invalid_request(chat, 400, None, "/v1/score or /v1/rerank")


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
async def test_use_activation_false_gives_the_raw_logits(
    demo_encoders: Mapping[str, pathlib.Path], arch: str
) -> None:
    """vLLM's use_activation (softmax and activation its older names): false scores a pair with the
    cross-encoder's raw logit, on /v1/score and /v1/rerank alike (was a 400)."""
    model_dir = demo_encoders[f"{arch}-reranker"]
    pairs = [(QUERY, d) for d in DOCS]
    logits, probs = _reference(model_dir, pairs, is_activated=False), _reference(model_dir, pairs)
    async with serve(model_dir) as http:
        for field in ("use_activation", "softmax", "activation"):
            body = {"model": MODEL, "text_1": QUERY, "text_2": DOCS, field: False}
            raw = await http.post("/v1/score", json=body)
            assert raw.status_code == 200, raw.text
            assert _scores(raw.json()) == pytest.approx(logits, abs=TOLERANCE)
        activated = await http.post(
            "/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS, "use_activation": True}
        )
        assert _scores(activated.json()) == pytest.approx(probs, abs=TOLERANCE)
        rerank = await http.post(
            "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS, "use_activation": False}
        )
        assert rerank.status_code == 200, rerank.text
        results = rerank.json()["results"]
        assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -logits[i])
        assert [r["relevance_score"] for r in results] == pytest.approx(
            sorted(logits, reverse=True), abs=TOLERANCE
        )


async def test_an_embedding_model_scores_by_cosine_similarity(
    demo_encoders: Mapping[str, pathlib.Path],
) -> None:
    """vLLM's score for an embedding model: a pair's score is the cosine similarity of the two
    texts' vectors (each distinct text embedded once), whether or not the model normalizes; was a
    400 saying to use /v1/embeddings."""
    embedder = demo_encoders["bert"]
    async with serve(embedder, pooler_config='{"normalize": false}') as http:
        name = (await http.get("/v1/models")).json()["data"][0]["id"]
        texts = [QUERY, *DOCS]
        embedded = await http.post("/v1/embeddings", json={"model": name, "input": texts})
        vectors = [torch.tensor(d["embedding"]) for d in embedded.json()["data"]]
        want = [float(torch.nn.functional.cosine_similarity(vectors[0], v, dim=0)) for v in vectors[1:]]
        score = await http.post("/v1/score", json={"model": name, "text_1": QUERY, "text_2": DOCS})
        assert score.status_code == 200, score.text
        assert _scores(score.json()) == pytest.approx(want, abs=1e-5)
        assert score.json()["usage"]["prompt_tokens"] == embedded.json()["usage"]["prompt_tokens"]
        body = {"model": name, "text_1": QUERY, "text_2": DOCS, "use_activation": False}
        raw = await http.post("/v1/score", json=body)  # vLLM's: a cosine whatever the vectors' scale
        assert _scores(raw.json()) == pytest.approx(want, abs=1e-5)
        rerank = await http.post("/v1/rerank", json={"model": name, "query": QUERY, "documents": DOCS})
        assert rerank.status_code == 200, rerank.text
        results = rerank.json()["results"]
        assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
        assert [r["relevance_score"] for r in results] == pytest.approx(sorted(want, reverse=True), abs=1e-5)


async def test_a_generating_engine_refuses_scores(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    async with serve(tiny_model_dirs["qwen3"], num_kv_blocks=64) as http:
        name = (await http.get("/v1/models")).json()["data"][0]["id"]
        score = await http.post("/v1/score", json={"model": name, "text_1": "a", "text_2": "b"})
        assert_invalid_request(score, 400, "model", "text generation")
        rerank = await http.post("/rerank", json={"model": name, "query": "a", "documents": ["b"]})
        assert_invalid_request(rerank, 400, "model", "text generation")
