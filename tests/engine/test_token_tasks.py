"""vLLM's per-token pooling tasks on encoders (--runner pooling): token_classify on token classifiers
(BertForTokenClassification and kin, which now load) and token_embed on embedding encoders, each
token's output equal to transformers', batched with other requests; what each engine refuses."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import pytest
import torch
from corral_engine import EngineArgs, PoolingParams
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.llm_engine import LLMEngine

from tests.engine.encoder_checkpoints import edit_tensors, save_hf_encoder

TOLERANCE = 2e-5  # float32 both sides; the order of sums differs
TEXTS = ["paris is the capital of france", "a", "the quick brown fox jumps over the lazy dog again"]


def _engine(model_dir: pathlib.Path, **kwargs: object) -> LLMEngine:
    kwargs.setdefault("dtype", "float32")
    return LLMEngine(EngineArgs(model=str(model_dir), max_model_len=64, **kwargs))  # type: ignore[arg-type]


def _run(engine: LLMEngine, requests: list[tuple[list[int], PoolingParams]]) -> list[list[float]]:
    """Every request added before the first step (several to a step); their outputs in order."""
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"r{i}", ids, params)
    outputs: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished and out.embedding is not None
            outputs[out.request_id] = out.embedding
    return [outputs[f"r{i}"] for i in range(len(requests))]


@pytest.mark.parametrize(
    "model_class",
    ["BertForTokenClassification", "RobertaForTokenClassification", "XLMRobertaForTokenClassification"],
)
def test_a_token_classifier_gives_each_tokens_probabilities_as_transformers(
    tmp_path: pathlib.Path, demo_encoders: Mapping[str, pathlib.Path], model_class: str
) -> None:
    """A checkpoint saved by transformers itself (4 labels): each token's softmax over its logits,
    or the logits themselves with activation "none"; the default task is token_classify."""
    arch = "bert" if model_class.startswith("Bert") else "xlm-roberta"
    overrides = {"type_vocab_size": 2} if arch == "bert" else {"pad_token_id": 1, "type_vocab_size": 1}
    model = save_hf_encoder(tmp_path, model_class, vocab_size=1024, num_labels=4, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((demo_encoders[arch] / name).read_bytes())
    engine = _engine(tmp_path)
    assert engine.embed.tasks == ("token_classify",) and engine.embed.labels == tuple(
        f"LABEL_{i}" for i in range(4)
    )
    prompts = [engine.tokenizer.encode(text) for text in TEXTS]
    probs = PoolingParams(task="token_classify")
    raw = PoolingParams(task="token_classify", activation="none")
    got = _run(engine, [(ids, probs) for ids in prompts] + [(prompts[0], raw)])
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([ids])).logits[0] for ids in prompts]  # [n, 4] each
    for flat, want in zip(got, logits, strict=False):
        assert torch.tensor(flat).view(-1, 4) == pytest.approx(torch.softmax(want, -1), abs=TOLERANCE)
    assert torch.tensor(got[-1]).view(-1, 4) == pytest.approx(logits[0], abs=1e-4)
    with pytest.raises(InvalidRequestError, match=r"token classification model.*serves token_classify"):
        engine.add_request("e", prompts[0], PoolingParams(task="token_embed"))
    with pytest.raises(InvalidRequestError, match="does not serve classify"):
        engine.add_request("c", prompts[0], PoolingParams(task="classify"))
    engine.close()


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_token_embed_gives_each_tokens_hidden_state_beside_pooled_requests(
    demo_encoders: Mapping[str, pathlib.Path], arch: str
) -> None:
    """token_embed: each token's last hidden state, normalized row by row as the pooler config says
    (or not, as asked), in the same steps as pooled embed requests, which are unchanged."""
    from transformers import AutoModel

    model_dir = demo_encoders[arch]
    engine = _engine(model_dir)
    assert engine.embed.tasks == ("embed", "token_embed")
    prompts = [engine.tokenizer.encode(text) for text in TEXTS]
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in prompts]  # [n, H]
    size = hidden[0].shape[-1]
    tokens = [(ids, PoolingParams(task="token_embed")) for ids in prompts]
    raw = (prompts[2], PoolingParams(task="token_embed", normalize=False))
    pooled = [(ids, PoolingParams()) for ids in prompts]
    got = _run(engine, [*tokens, raw, *pooled])
    for flat, want in zip(got, hidden, strict=False):
        assert torch.tensor(flat).view(-1, size) == pytest.approx(
            torch.nn.functional.normalize(want, dim=-1), abs=TOLERANCE
        )
    assert torch.tensor(got[3]).view(-1, size) == pytest.approx(hidden[2], abs=1e-4)
    assert all(len(flat) == size for flat in got[4:])  # the pooled requests: one vector each
    engine.close()


def test_a_token_classifier_missing_its_head_is_refused(tmp_path: pathlib.Path) -> None:
    save_hf_encoder(tmp_path, "BertForTokenClassification", num_labels=3)
    edit_tensors(tmp_path, lambda t: {k: v for k, v in t.items() if not k.startswith("classifier.")})
    from corral_engine.model.encoder_loader import load_encoder

    with pytest.raises(ModelLoadError, match=r"missing tensors: classifier\.bias, classifier\.weight"):
        load_encoder(tmp_path, torch.float32, "cpu")


def test_a_sequence_classifier_refuses_the_token_tasks(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    engine = _engine(demo_encoders["bert-classifier"])
    for task in ("token_classify", "token_embed"):
        with pytest.raises(
            InvalidRequestError, match=f"does not serve {task}|{task} needs a token classification"
        ):
            engine.add_request(task, [2, 5, 3], PoolingParams(task=task))  # type: ignore[arg-type]
    engine.close()
