"""POST /classify (vLLM's classification API; and /v1/classify) on a real sequence-classifier
engine, through httpx (the openai client has no such call): each input's label probabilities as
transformers computes them (softmax over labels, one label's sigmoid, or as config.json's
problem_type says), its likeliest label by name, token-id inputs, truncation, the engine core in
its own process; OpenAI-shaped refusals, and the route refused on other engines."""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
import torch

from tests.server.real_engine import assert_invalid_request, http_client

MODEL = "classifier"
TOLERANCE = 2e-5  # float32 both sides
TEXTS = [
    "a wonderful film, i loved every minute of it",
    "the service was slow and the food was cold",
    "a",
    "it rained all day in berlin and every museum was closed",
]


def serve(model_dir: pathlib.Path, **args: Any) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
    """A float32 engine of a 64-token context serving `model_dir` as MODEL, reached by httpx."""
    return http_client(model_dir, max_model_len=64, served_model_name=MODEL, **args)


def _logits(model_dir: pathlib.Path, texts: list[str]) -> list[torch.Tensor]:
    """transformers' AutoModelForSequenceClassification, each text alone: its logits [num_labels]."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(**tokenizer(text, return_tensors="pt")).logits[0] for text in texts]


def _data(body: dict[str, Any], num_inputs: int) -> list[dict[str, Any]]:
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(num_inputs))
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0 and usage["completion_tokens"] == 0
    return list(body["data"])


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
async def test_probabilities_and_labels_are_transformers_softmax(
    demo_encoders: Mapping[str, pathlib.Path], arch: str
) -> None:
    model_dir = demo_encoders[f"{arch}-classifier"]
    want = [torch.softmax(logits, dim=-1) for logits in _logits(model_dir, TEXTS)]
    async with serve(model_dir) as http:
        resp = await http.post("/classify", json={"model": MODEL, "input": TEXTS})
        assert resp.status_code == 200, resp.text
        for item, probs in zip(_data(resp.json(), len(TEXTS)), want, strict=True):
            assert item["num_classes"] == 3 and len(item["probs"]) == 3
            assert item["probs"] == pytest.approx(probs.tolist(), abs=TOLERANCE)
            assert item["label"] == f"LABEL_{int(probs.argmax())}"
        one = await http.post("/v1/classify", json={"model": MODEL, "input": TEXTS[1]})
        assert one.status_code == 200, one.text
        assert _data(one.json(), 1)[0]["probs"] == pytest.approx(want[1].tolist(), abs=TOLERANCE)


async def test_token_ids_and_truncation(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    """Token ids run as given; truncate_prompt_tokens keeps the last k (vLLM's)."""
    from transformers import AutoTokenizer

    model_dir = demo_encoders["bert-classifier"]
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXTS[3]).input_ids
    want = torch.softmax(_logits(model_dir, [TEXTS[3]])[0], dim=-1).tolist()
    async with serve(model_dir) as http:
        for given in (ids, [ids, ids[:3]]):
            resp = await http.post("/classify", json={"model": MODEL, "input": given})
            assert resp.status_code == 200, resp.text
            assert resp.json()["data"][0]["probs"] == pytest.approx(want, abs=TOLERANCE)
        cut = await http.post("/classify", json={"model": MODEL, "input": ids, "truncate_prompt_tokens": 4})
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] == 4
        again = await http.post("/classify", json={"model": MODEL, "input": ids[-4:]})
        assert cut.json()["data"] == again.json()["data"]


async def test_one_label_is_its_sigmoid(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    model_dir = demo_encoders["bert-reranker"]
    want = [torch.sigmoid(logits).tolist() for logits in _logits(model_dir, TEXTS[:2])]
    async with serve(model_dir) as http:
        resp = await http.post("/classify", json={"model": MODEL, "input": TEXTS[:2]})
        assert resp.status_code == 200, resp.text
        data = _data(resp.json(), 2)
        assert [d["probs"] for d in data] == [pytest.approx(w, abs=TOLERANCE) for w in want]
        assert [(d["label"], d["num_classes"]) for d in data] == [("LABEL_0", 1)] * 2


def _with_config(model_dir: pathlib.Path, out: pathlib.Path, **changes: Any) -> pathlib.Path:
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize(
    ("problem_type", "activate"),
    [
        ("multi_label_classification", torch.sigmoid),  # each label's own probability
        ("regression", lambda logits: logits),  # the raw outputs
        ("single_label_classification", lambda logits: torch.softmax(logits, dim=-1)),
    ],
)
async def test_the_problem_type_chooses_the_activation(
    demo_encoders: Mapping[str, pathlib.Path], tmp_path: pathlib.Path, problem_type: str, activate: Any
) -> None:
    labels = {"0": "negative", "1": "neutral", "2": "positive"}
    model_dir = _with_config(
        demo_encoders["bert-classifier"], tmp_path / "m", problem_type=problem_type, id2label=labels
    )
    logits = _logits(model_dir, TEXTS[:2])
    async with serve(model_dir) as http:
        resp = await http.post("/classify", json={"model": MODEL, "input": TEXTS[:2]})
        assert resp.status_code == 200, resp.text
        for item, row in zip(_data(resp.json(), 2), logits, strict=True):
            assert item["probs"] == pytest.approx(activate(row).tolist(), abs=TOLERANCE)
            assert item["label"] == labels[str(int(row.argmax()))]


async def test_use_activation_false_gives_the_logits(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    model_dir = demo_encoders["xlm-roberta-classifier"]
    logits = _logits(model_dir, TEXTS[:1])[0]
    async with serve(model_dir) as http:
        for field in ("use_activation", "softmax", "activation"):  # the last two: vLLM's older names
            resp = await http.post("/classify", json={"model": MODEL, "input": TEXTS[0], field: False})
            assert resp.status_code == 200, resp.text
            assert resp.json()["data"][0]["probs"] == pytest.approx(logits.tolist(), abs=TOLERANCE)


async def test_the_engine_core_in_its_own_process_classifies(
    demo_encoders: Mapping[str, pathlib.Path],
) -> None:
    model_dir = demo_encoders["bert-classifier"]
    want = [torch.softmax(logits, dim=-1).tolist() for logits in _logits(model_dir, TEXTS)]
    async with serve(model_dir, in_own_process=True) as http:
        resp = await http.post("/classify", json={"model": MODEL, "input": TEXTS})
        assert resp.status_code == 200, resp.text
        assert [d["probs"] for d in _data(resp.json(), len(TEXTS))] == [
            pytest.approx(w, abs=TOLERANCE) for w in want
        ]


async def test_refusals_are_openai_shaped(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    long_text = " ".join(["capital"] * 80)
    async with serve(demo_encoders["bert-classifier"]) as http:
        empty = await http.post("/classify", json={"model": MODEL, "input": ""})
        assert_invalid_request(empty, 400, "input", "empty")
        none = await http.post("/classify", json={"model": MODEL, "input": []})
        assert_invalid_request(none, 400, "input", "empty")
        too_long = await http.post("/classify", json={"model": MODEL, "input": ["a", long_text]})
        assert_invalid_request(too_long, 400, "input.1", "maximum context length is 64 tokens")
        cut = await http.post(
            "/classify", json={"model": MODEL, "input": ["a", long_text], "truncate_prompt_tokens": -1}
        )
        assert cut.status_code == 200, cut.text
        messages = [{"role": "user", "content": "a"}]
        chat = await http.post("/classify", json={"model": MODEL, "input": "a", "messages": messages})
        assert_invalid_request(chat, 400, "messages", "send `input`")
        no_input = await http.post("/classify", json={"model": MODEL, "messages": messages})
        assert_invalid_request(no_input, 400, "input", "")
        ahead = await http.post("/classify", json={"model": MODEL, "input": "a", "priority": 1})
        assert_invalid_request(ahead, 400, "priority", "first come, first served")
        score = await http.post("/v1/score", json={"model": MODEL, "text_1": "a", "text_2": "b"})
        assert_invalid_request(score, 400, "model", "/classify")
        embed = await http.post("/v1/embeddings", json={"model": MODEL, "input": "a"})
        assert_invalid_request(embed, 400, "model", "use /classify")
        completion = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert_invalid_request(completion, 400, None, "use /classify")


async def test_other_engines_refuse_classify(
    demo_encoders: Mapping[str, pathlib.Path], tiny_model_dirs: Mapping[str, pathlib.Path]
) -> None:
    async with serve(demo_encoders["bert"]) as http:
        resp = await http.post("/classify", json={"model": MODEL, "input": "a"})
        assert_invalid_request(resp, 400, "model", "an embedding model")
    async with serve(tiny_model_dirs["llama"], num_kv_blocks=64) as http:
        resp = await http.post("/classify", json={"model": MODEL, "input": "a"})
        assert_invalid_request(resp, 400, "model", "text generation")
