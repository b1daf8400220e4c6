"""POST /pooling (vLLM's generic pooling API): `task` embed or classify gives what /v1/embeddings and
/classify give, in vLLM's pooling shape; token_embed each token's hidden state (normalized as the
model's pooler says) and token_classify a token classifier's label probabilities for each token,
both as transformers computes them; no task is the model's own (vLLM's default); a task the model
cannot do is an OpenAI-shaped 400 saying why."""

from __future__ import annotations

import base64
import pathlib
import struct
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from tests.server.real_engine import assert_invalid_request, http_client

MODEL = "pooler"
TOLERANCE = 2e-5  # float32 both sides
TEXTS = ["the quick brown fox", "paris is the capital of france"]


def _data(body: dict[str, Any], num_inputs: int) -> list[Any]:
    assert body["object"] == "list" and body["id"].startswith("pool-") and body["model"] == MODEL
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "pooling") for i in range(num_inputs)]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    return [d["data"] for d in body["data"]]


def _reference(model_dir: pathlib.Path, head: str) -> list[torch.Tensor]:
    """transformers' outputs of each text alone: the last hidden state [n, H] (head "model") or a
    token classifier's logits [n, labels] (head "token")."""
    from transformers import AutoModel, AutoModelForTokenClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cls = AutoModelForTokenClassification if head == "token" else AutoModel
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        outs = [model(**tokenizer(text, return_tensors="pt")) for text in TEXTS]
    return [out.logits[0] if head == "token" else out.last_hidden_state[0] for out in outs]


async def test_task_embed_and_no_task_give_the_embeddings(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    """Without a task, an embedding model's /pooling embeds (vLLM's default: the model's own task;
    was a 400 asking for one)."""
    async with http_client(demo_encoders["bert"], max_model_len=64, served_model_name=MODEL) as http:
        want = await http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS, "normalize": False})
        vectors = [d["embedding"] for d in want.json()["data"]]
        got = await http.post(
            "/pooling", json={"model": MODEL, "input": TEXTS, "task": "embed", "normalize": False}
        )
        assert got.status_code == 200, got.text
        assert _data(got.json(), 2) == vectors
        default = await http.post("/pooling", json={"model": MODEL, "input": TEXTS, "use_activation": False})
        assert default.status_code == 200, default.text
        assert _data(default.json(), 2) == vectors  # use_activation false: not normalized (vLLM's)
        other = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "classify"})
        assert_invalid_request(other, 400, "task", "serves embed, token_embed")
        tokens = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "token_classify"})
        assert_invalid_request(tokens, 400, "task", "*ForTokenClassification")
        unknown = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "encode"})
        assert_invalid_request(unknown, 400, "task", "Unsupported task 'encode'")
        cut = {"model": MODEL, "input": "a", "task": "embed", "dimensions": 8}
        dims = await http.post("/pooling", json=cut)
        assert_invalid_request(dims, 400, "dimensions", "not supported")


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
async def test_token_embed_gives_each_tokens_hidden_state(
    demo_encoders: Mapping[str, pathlib.Path], arch: str
) -> None:
    """vLLM's token_embed: one vector a prompt token, each scaled to unit length as the model's
    pooler normalizes (its sentence-transformers Normalize), or not with normalize false."""
    model_dir = demo_encoders[arch]
    hidden = _reference(model_dir, "model")
    async with http_client(model_dir, max_model_len=64, served_model_name=MODEL) as http:
        resp = await http.post("/pooling", json={"model": MODEL, "input": TEXTS, "task": "token_embed"})
        assert resp.status_code == 200, resp.text
        for rows, want in zip(_data(resp.json(), 2), hidden, strict=True):
            assert torch.tensor(rows) == pytest.approx(
                torch.nn.functional.normalize(want, dim=-1), abs=TOLERANCE
            )
        body = {"model": MODEL, "input": TEXTS[1], "task": "token_embed", "normalize": False}
        raw = await http.post("/pooling", json=body)
        assert torch.tensor(_data(raw.json(), 1)[0]) == pytest.approx(hidden[1], abs=1e-4)
        packed = await http.post("/pooling", json={**body, "encoding_format": "base64"})
        flat = base64.b64decode(_data(packed.json(), 1)[0])
        assert struct.unpack(f"<{hidden[1].numel()}f", flat) == pytest.approx(
            hidden[1].flatten().tolist(), abs=1e-4
        )


async def test_token_classify_gives_each_tokens_label_probabilities(
    demo_encoders: Mapping[str, pathlib.Path],
) -> None:
    """A token classifier (BertForTokenClassification): each token's softmax over its labels, the
    model's default task; use_activation false gives the logits; the other routes refuse it."""
    model_dir = demo_encoders["bert-token-classifier"]
    logits = _reference(model_dir, "token")
    async with http_client(model_dir, max_model_len=64, served_model_name=MODEL) as http:
        for body in ({"task": "token_classify"}, {}):
            resp = await http.post("/pooling", json={"model": MODEL, "input": TEXTS, **body})
            assert resp.status_code == 200, resp.text
            for rows, want in zip(_data(resp.json(), 2), logits, strict=True):
                assert torch.tensor(rows) == pytest.approx(torch.softmax(want, dim=-1), abs=TOLERANCE)
        raw = await http.post("/pooling", json={"model": MODEL, "input": TEXTS[0], "use_activation": False})
        assert torch.tensor(_data(raw.json(), 1)[0]) == pytest.approx(logits[0], abs=1e-4)
        embed = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "token_embed"})
        assert_invalid_request(embed, 400, "task", "serves token_classify")
        for path, body in (
            ("/classify", {"input": "a"}),
            ("/v1/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/embeddings", {"input": "a"}),
        ):
            refused = await http.post(path, json={"model": MODEL, **body})
            assert_invalid_request(refused, 400, "model", "/pooling (task token_classify)")
    async with http_client(model_dir, True, max_model_len=64, served_model_name=MODEL) as http:
        resp = await http.post("/pooling", json={"model": MODEL, "input": TEXTS})  # the core apart
        assert resp.status_code == 200, resp.text
        for rows, want in zip(_data(resp.json(), 2), logits, strict=True):
            assert torch.tensor(rows) == pytest.approx(torch.softmax(want, dim=-1), abs=TOLERANCE)


async def test_task_classify_gives_the_probabilities(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    model_dir = demo_encoders["bert-classifier"]
    async with http_client(model_dir, max_model_len=64, served_model_name=MODEL) as http:
        want = await http.post("/classify", json={"model": MODEL, "input": TEXTS})
        probs = [d["probs"] for d in want.json()["data"]]
        for body in ({"task": "classify"}, {}):
            got = await http.post("/pooling", json={"model": MODEL, "input": TEXTS, **body})
            assert got.status_code == 200, got.text
            assert _data(got.json(), 2) == probs
        tokens = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "token_classify"})
        assert_invalid_request(tokens, 400, "task", "token classification model (*ForTokenClassification)")


async def test_a_decoder_embedding_model_refuses_token_embed(tmp_path: pathlib.Path) -> None:
    """A decoder's prompt rows are chunked and its prefixes cached: token_embed is refused by name."""
    from corral_engine.demo_embedding import make_embedding_model
    from corral_engine.demo_model import write_demo_model

    model_dir = make_embedding_model(write_demo_model(tmp_path / "emb", preset="tiny"), base_model_class=True)
    async with http_client(model_dir, num_kv_blocks=64, served_model_name=MODEL) as http:
        resp = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "token_embed"})
        assert_invalid_request(resp, 400, "task", "encoder models (BERT, RoBERTa, XLM-RoBERTa) only")


async def test_a_generating_engine_refuses_pooling(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    async with http_client(tiny_model_dirs["llama"], num_kv_blocks=64, served_model_name=MODEL) as http:
        resp = await http.post("/pooling", json={"model": MODEL, "input": "a", "task": "embed"})
        assert_invalid_request(resp, 400, "model", "text generation")
