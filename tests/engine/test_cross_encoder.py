"""Cross-encoders (rerankers: BertForSequenceClassification, XLMRobertaForSequenceClassification)
served with --runner pooling: the engine's scores equal transformers' AutoModelForSequenceClassification
on the tokenizer's pair encoding, batched pairs of different lengths; the head loads; what such an
engine refuses, and what an embedding engine refuses of score requests."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import pytest
import torch
from corral_engine import EngineArgs, PoolingParams
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.llm_engine import LLMEngine

from tests.engine.encoder_checkpoints import edit_config, edit_tensors, save_hf_encoder

TOLERANCE = 2e-5  # float32 both sides; the order of sums differs
PAIRS = [
    ("what is the capital of france", "paris is the capital of france"),
    ("what is the capital of france", "the quick brown fox jumps over the lazy dog again and again"),
    ("a", "b"),
    ("how many people live in berlin", "berlin is well known for its museums and its long history"),
]


def _engine(model_dir: pathlib.Path, **kwargs: object) -> LLMEngine:
    kwargs.setdefault("dtype", "float32")
    return LLMEngine(EngineArgs(model=str(model_dir), **kwargs))  # type: ignore[arg-type]


def _pair_request(tokenizer: object, first: str, second: str) -> tuple[list[int], PoolingParams]:
    """The pair's token ids and its params, as the score route builds them."""
    encoded = tokenizer(first, second)  # type: ignore[operator]
    types = encoded.get("token_type_ids") or []
    start = types.index(1) if 1 in types else None
    return list(encoded["input_ids"]), PoolingParams(task="classify", second_segment_start=start)


def _reference(model_dir: pathlib.Path, pairs: list[tuple[str, str]]) -> list[list[float]]:
    """transformers' sequence classifier on each pair alone, sigmoid of its one logit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            torch.sigmoid(model(**tokenizer(a, b, return_tensors="pt")).logits[0]).tolist() for a, b in pairs
        ]


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_scores_equal_transformers_on_pair_encodings_batched(
    demo_encoders: Mapping[str, pathlib.Path], arch: str
) -> None:
    engine = _engine(demo_encoders[f"{arch}-reranker"], max_model_len=64)
    assert engine.runner_type == "pooling" and engine.embed.task == "classify"
    pairs = PAIRS * 3  # pairs of different lengths, several to a step
    for i, (a, b) in enumerate(pairs):
        ids, params = _pair_request(engine.tokenizer, a, b)
        if arch == "bert":
            assert params.second_segment_start is not None  # BERT's second text is type 1
        engine.add_request(f"r{i}", ids, params)
    scores: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished and out.embedding is not None
            scores[out.request_id] = out.embedding
    expected = _reference(demo_encoders[f"{arch}-reranker"], pairs)
    for i, want in enumerate(expected):
        assert len(scores[f"r{i}"]) == 1
        assert scores[f"r{i}"][0] == pytest.approx(want[0], abs=TOLERANCE)
    assert len({round(s[0], 6) for s in scores.values()}) == len(PAIRS)  # the pairs score differently
    engine.close()


def test_bert_token_types_change_the_score(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    """Without the second segment's token types a BERT pair scores otherwise (transformers' type-1 rows)."""
    engine = _engine(demo_encoders["bert-reranker"], max_model_len=64)
    ids, params = _pair_request(engine.tokenizer, *PAIRS[0])
    [with_types, without] = engine.generate([ids, ids], [params, PoolingParams(task="classify")])
    assert with_types.embedding != pytest.approx(without.embedding, abs=1e-4)  # type: ignore[arg-type]
    engine.close()


@pytest.mark.parametrize(
    "model_class", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"]
)
def test_a_transformers_classifier_with_labels_loads_and_matches(
    tmp_path: pathlib.Path, demo_encoders: Mapping[str, pathlib.Path], model_class: str
) -> None:
    """A checkpoint saved by transformers itself (3 labels: softmax), tokenizer from the demo."""
    arch = "bert" if model_class.startswith("Bert") else "xlm-roberta"
    overrides = {"type_vocab_size": 2} if arch == "bert" else {"pad_token_id": 1, "type_vocab_size": 1}
    model = save_hf_encoder(tmp_path, model_class, vocab_size=1024, num_labels=3, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((demo_encoders[f"{arch}-reranker"] / name).read_bytes())
    engine = _engine(tmp_path)
    assert engine.embed.num_labels == 3
    ids, params = _pair_request(engine.tokenizer, *PAIRS[1])
    [out] = engine.generate([ids], params)
    types = torch.zeros(len(ids), dtype=torch.long)
    if params.second_segment_start is not None:
        types[params.second_segment_start :] = 1
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), token_type_ids=types[None]).logits[0]
    assert out.embedding == pytest.approx(torch.softmax(logits, -1).tolist(), abs=TOLERANCE)
    engine.close()


def test_a_classifier_missing_its_head_is_refused(tmp_path: pathlib.Path) -> None:
    save_hf_encoder(tmp_path, "BertForSequenceClassification", num_labels=1)
    edit_tensors(tmp_path, lambda t: {k: v for k, v in t.items() if not k.startswith("classifier.")})
    with pytest.raises(ModelLoadError, match=r"missing tensors: classifier\.bias, classifier\.weight"):
        from corral_engine.model.encoder_loader import load_encoder

        load_encoder(tmp_path, torch.float32, "cpu")


def test_an_embedding_model_keeps_skipping_the_pooler(tmp_path: pathlib.Path) -> None:
    save_hf_encoder(tmp_path, "BertModel")  # holds pooler.dense.*, as hub checkpoints do
    edit_config(tmp_path, architectures=["BertModel"])
    from corral_engine.model.encoder_loader import load_encoder

    _, model = load_encoder(tmp_path, torch.float32, "cpu")
    assert model.classifier is None


def test_a_reranker_does_not_generate(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"an encoder: it serves scores only \(--runner pooling\)"):
        _engine(demo_encoders["bert-reranker"], runner="generate")


def test_each_engine_refuses_the_other_task(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    reranker = _engine(demo_encoders["bert-reranker"], max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"cross-encoder.*does not serve embed requests.*/v1/score"):
        reranker.add_request("e", [2, 5, 3], PoolingParams())
    reranker.close()
    embedder = _engine(demo_encoders["bert"], max_model_len=64)
    with pytest.raises(
        InvalidRequestError, match=r"an embedding model: it does not serve classify.*/v1/embeddings"
    ):
        embedder.add_request("s", [2, 5, 3], PoolingParams(task="classify"))
    embedder.close()
