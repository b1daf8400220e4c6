"""Simulated classifiers (--runner pooling on a *ForSequenceClassification or *ForTokenClassification
checkpoint, as rerankers and NER models ship): served as the engine serves them, each output of
the engine's shape (a score a pair, labels from id2label, a row a token), deterministic, activated
as asked; the per-token embeddings of a simulated encoder; and `--simulate` taking a reranker
(was refused by name)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
from corral_cli import cmd_engine
from corral_cli.simulate import replica_spec
from corral_engine.errors import InvalidRequestError
from corral_engine.pooling_params import PoolingParams
from corral_engine.server import create_app
from corral_engine.sim.embedding import sim_pooling
from corral_engine.sim.engine import SimEngine
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import BUILTIN, StepShape
from corral_engine.sim.tokenizer import LightTokenizer

PROFILE = BUILTIN["h100-bge-large"]
QUERY = "what is the capital of france"
DOCS = ["the quick brown fox", "paris is the capital of france", "a"]


@contextlib.asynccontextmanager
async def _serve(model_dir: pathlib.Path) -> AsyncIterator[httpx.AsyncClient]:
    """A client of one simulated replica of `model_dir` (--runner auto) behind the real server."""
    spec = ReplicaSpec(PROFILE, model_dir, "m", pooling=sim_pooling(model_dir, "auto", None, "m"))
    [engine] = build_engines(spec, 1)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json={"model": "m", **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


async def test_a_simulated_reranker_scores_each_pair(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    """A score a pair in (0, 1), the same on every call; rerank orders by it; use_activation false
    gives the logit whose sigmoid is the score; the engine's refusals."""
    async with _serve(demo_encoders["bert-reranker"]) as client:
        body = {"text_1": QUERY, "text_2": DOCS}
        scores = [d["score"] for d in (await _post(client, "/v1/score", body))["data"]]
        assert len(scores) == 3 and all(0.0 < s < 1.0 for s in scores) and len(set(scores)) == 3
        again = [d["score"] for d in (await _post(client, "/v1/score", body))["data"]]
        assert again == scores
        logits = [
            d["score"] for d in (await _post(client, "/v1/score", {**body, "use_activation": False}))["data"]
        ]
        assert [_sigmoid(x) for x in logits] == pytest.approx(scores)
        ranked = (await _post(client, "/v1/rerank", {"query": QUERY, "documents": DOCS}))["results"]
        assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -scores[i])
        assert [r["relevance_score"] for r in ranked] == sorted(scores, reverse=True)
        refused = await client.post("/v1/embeddings", json={"model": "m", "input": "a"})
        assert refused.status_code == 400 and "/v1/score" in refused.json()["error"]["message"]


async def test_a_simulated_classifier_names_its_labels(
    demo_encoders: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """/classify: probabilities over config.json's labels (summing to 1), the likeliest by its
    id2label name; /pooling classify the same probabilities."""
    model_dir = tmp_path / "sentiment"
    model_dir.mkdir()
    source = demo_encoders["bert-classifier"]
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":  # a simulated replica reads no weights
            (model_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    names = ["negative", "neutral", "positive"]
    config.update(id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    (model_dir / "config.json").write_text(json.dumps(config))
    async with _serve(model_dir) as client:
        texts = ["i loved it", "not my thing"]
        data = (await _post(client, "/classify", {"input": texts}))["data"]
        for item in data:
            assert item["num_classes"] == 3 and sum(item["probs"]) == pytest.approx(1.0)
            assert item["label"] == names[max(range(3), key=item["probs"].__getitem__)]
        pooled = (await _post(client, "/pooling", {"input": texts}))["data"]
        assert [d["data"] for d in pooled] == [item["probs"] for item in data]
        score = await client.post("/v1/score", json={"model": "m", "text_1": "a", "text_2": "b"})
        assert score.status_code == 400 and "3 labels" in score.json()["error"]["message"]


async def test_a_simulated_token_classifier_and_encoder_give_a_row_a_token(
    demo_encoders: Mapping[str, pathlib.Path],
) -> None:
    """token_classify: each token's probabilities over the labels; token_embed on an encoder: each
    token's unit vector of the hidden size; one row a prompt token."""
    async with _serve(demo_encoders["bert-token-classifier"]) as client:
        body = await _post(client, "/pooling", {"input": "paris is in france"})
        rows = body["data"][0]["data"]
        assert len(rows) == body["usage"]["prompt_tokens"] > 2
        assert all(len(row) == 5 and sum(row) == pytest.approx(1.0) for row in rows)
        assert rows[0] != rows[1]
        refused = await client.post("/classify", json={"model": "m", "input": "a"})
        assert refused.status_code == 400 and "token_classify" in refused.json()["error"]["message"]
    async with _serve(demo_encoders["bert"]) as client:
        body = await _post(client, "/pooling", {"input": "paris is in france", "task": "token_embed"})
        rows = body["data"][0]["data"]
        assert len(rows) == body["usage"]["prompt_tokens"]
        assert all(len(row) == 64 and math.hypot(*row) == pytest.approx(1.0) for row in rows)


def test_a_classifier_is_timed_as_its_encoder_and_checked_as_the_engine_checks(
    demo_encoders: Mapping[str, pathlib.Path],
) -> None:
    """A reranker's prompts run whole, timed as an embedding encoder's of the same tokens; a task it
    does not serve is refused before it is queued."""
    engines = {}
    for name in ("bert", "bert-reranker"):
        pooling = sim_pooling(demo_encoders[name], "auto", None, "m")
        assert pooling is not None and pooling.is_encoder
        engines[name] = SimEngine(
            PROFILE, LightTokenizer(demo_encoders[name]), "m", clock=lambda: 0.0, pooling=pooling
        )
    reranker = engines["bert-reranker"]
    assert reranker.embed.tasks == ("classify",) and reranker.embed.labels == ("LABEL_0",)
    durations = []
    for engine, task in ((engines["bert"], "embed"), (reranker, "classify")):
        engine.add_request("r", [5] * 40, PoolingParams(task=task))  # type: ignore[arg-type]
        step = engine.begin_step()
        assert step is not None and not engine.scheduler.config.can_chunk_prompts
        durations.append(step.duration_s)
        assert step.duration_s == PROFILE.step_time_s(StepShape.of(step.scheduled.scheduled))
        [out] = engine.finish_step(step)
        assert len(out.embedding or []) == (64 if task == "embed" else 1)
    assert durations[0] == durations[1]
    with pytest.raises(InvalidRequestError, match="token_classify needs a token classification model"):
        reranker.add_request("t", [5, 6], PoolingParams(task="token_classify"))


def test_simulate_takes_a_reranker(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    """`corral engine --simulate` (and so `corral up --simulate`) on a reranker: a pooling replica
    serving scores (was: ModelLoadError, the simulator does not serve /v1/score)."""
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    args = parser.parse_args(
        ["--simulate", "h100-bge-large", "--model", str(demo_encoders["xlm-roberta-reranker"])]
    )
    spec = replica_spec(args, cmd_engine.engine_args_from(args))
    assert spec.pooling is not None and spec.pooling.embed.num_labels == 1
    assert spec.pooling.embed.routes().startswith("/v1/score")
