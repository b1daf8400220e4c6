"""Encoder embedding models served (BERT, XLM-RoBERTa; --runner pooling): the engine's vectors equal
transformers' pooled as the sentence-transformers files say, batched over several steps with each
prompt whole; what such an engine refuses; /v1/embeddings through the official openai client."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import httpx
import openai
import pytest
import torch
from corral_engine import EngineArgs, PoolingParams
from corral_engine.async_engine import AsyncEngine
from corral_engine.errors import ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.server.app import create_app

from tests.engine.encoder_checkpoints import save_hf_encoder

TOLERANCE = 2e-5  # float32 both sides; the order of sums differs
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog again and again",
    "a",
    "embeddings for retrieval",
    "one more sentence with several words in it to make the batch longer than one step",
]


def _engine(model_dir: pathlib.Path, **kwargs: object) -> LLMEngine:
    kwargs.setdefault("dtype", "float32")
    return LLMEngine(EngineArgs(model=str(model_dir), **kwargs))  # type: ignore[arg-type]


def _reference(model_dir: pathlib.Path, texts: list[str], pooling: str) -> list[torch.Tensor]:
    """transformers' AutoModel and tokenizer, each text alone, pooled by hand and normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]  # [T, H]
            vector = hidden.mean(dim=0) if pooling == "MEAN" else hidden[0]
            out.append(torch.nn.functional.normalize(vector, dim=-1))
    return out


@pytest.mark.parametrize(("arch", "pooling"), [("bert", "MEAN"), ("xlm-roberta", "CLS")])
def test_vectors_equal_transformers_with_prompts_whole_over_several_steps(
    demo_encoders: Mapping[str, pathlib.Path], arch: str, pooling: str
) -> None:
    # --max-num-batched-tokens 20 is raised to --max-model-len 64 (a prompt must fit a step whole):
    # the batch takes several steps, and a prompt that does not fit what is left of one waits whole.
    engine = _engine(demo_encoders[arch], max_num_batched_tokens=20, max_model_len=64)
    assert engine.runner_type == "pooling" and engine.pooler_config is not None
    assert engine.pooler_config.pooling_type == pooling
    texts = TEXTS * 4  # more tokens than one step's budget of max_model_len
    for i, text in enumerate(texts):
        engine.add_request(f"r{i}", text, PoolingParams())
    vectors: dict[str, list[float]] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished and out.embedding is not None
            vectors[out.request_id] = out.embedding
        num_steps += 1
        assert engine.scheduler.num_running == 0  # each prompt ran whole and ended in its step
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert num_steps > 1
    want = _reference(demo_encoders[arch], TEXTS, pooling)
    for i, text in enumerate(texts):
        got, w = torch.tensor(vectors[f"r{i}"]), want[TEXTS.index(text)]
        assert torch.allclose(got, w, atol=TOLERANCE, rtol=0), (got - w).abs().max()


def _bare_encoder(path: pathlib.Path, model_class: str, demo_encoders: Mapping[str, pathlib.Path]) -> object:
    """transformers' own save of `model_class` with the demo BERT's tokenizer, and no
    sentence-transformers files."""
    model = save_hf_encoder(path, model_class)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(demo_encoders["bert"] / name, path / name)
    return model


def test_without_sentence_transformers_files_an_encoder_pools_its_first_token(
    demo_encoders: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    model: Any = _bare_encoder(tmp_path / "bert", "BertModel", demo_encoders)
    engine = _engine(tmp_path / "bert")
    assert engine.pooler_config is not None and engine.pooler_config.pooling_type == "CLS"
    prompt = [5, 17, 42, 9]
    [out] = engine.generate([prompt], PoolingParams(normalize=False))
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([prompt])).last_hidden_state[0, 0]
    assert torch.allclose(torch.tensor(out.embedding), want, atol=TOLERANCE, rtol=0)


def test_a_masked_lm_checkpoint_serves_embeddings_under_runner_auto_without_prefix_caching(
    demo_encoders: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """Even last-token pooling, which keeps the prefix cache on a decoder, turns it off: an encoder
    position's state depends on the tokens after it, and nothing is cached."""
    _bare_encoder(tmp_path / "mlm", "BertForMaskedLM", demo_encoders)
    engine = _engine(tmp_path / "mlm", pooler_config='{"pooling_type": "LAST"}', block_size=4)
    assert engine.runner_type == "pooling"
    assert not engine.block_manager.enable_prefix_caching
    prompt = list(range(3, 40))
    first, second = (engine.generate([prompt], PoolingParams())[0] for _ in range(2))
    assert first.embedding == second.embedding


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"runner": "generate"}, "BertModel is an encoder: it serves embeddings only (--runner pooling)"),
        ({"quantization": "int8"}, "does not take --quantization"),
    ],
)
def test_what_an_encoder_engine_refuses(
    demo_encoders: Mapping[str, pathlib.Path], flags: dict[str, object], said: str
) -> None:
    with pytest.raises(ModelLoadError, match=said.replace("(", r"\(").replace(")", r"\)")):
        _engine(demo_encoders["bert"], **flags)


async def test_the_openai_client_gets_the_engines_vectors(demo_encoders: Mapping[str, pathlib.Path]) -> None:
    model_dir = demo_encoders["bert"]
    want = _reference(model_dir, TEXTS[:2], "MEAN")
    app = create_app(AsyncEngine(EngineArgs(model=str(model_dir), dtype="float32", served_model_name="bert")))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0
            )
            result = await client.embeddings.create(model="bert", input=TEXTS[:2])  # base64 on the wire
            for item, w in zip(result.data, want, strict=True):
                got = torch.tensor(item.embedding)
                assert torch.allclose(got, w, atol=TOLERANCE, rtol=0), (got - w).abs().max()
            with pytest.raises(openai.BadRequestError, match="embedding model"):
                await client.completions.create(model="bert", prompt="hi", max_tokens=2)
