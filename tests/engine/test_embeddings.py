"""Embedding models (--runner pooling): the engine's vectors equal transformers' base model pooled
by hand (last token, mean, CLS), alone, batched, chunked, after a prefix-cache hit and after
preemption; a request's blocks are freed when its vector is out, or when it is aborted mid-prompt."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from corral_engine import EngineArgs, PoolingParams, SamplingParams
from corral_engine.demo_embedding import make_embedding_model
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.llm_engine import LLMEngine

from tests.engine.helpers import make_engine, random_prompts

TOLERANCE = 2e-5  # float32 on both sides; only the order of the sums differs


def _embedding_copy(src: pathlib.Path, dst: pathlib.Path, pooling: str, **kwargs: object) -> pathlib.Path:
    shutil.copytree(src, dst)
    return make_embedding_model(dst, pooling, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def qwen3_embedding(tiny_model_dirs, tmp_path_factory) -> pathlib.Path:  # type: ignore[no-untyped-def]
    """Qwen3-Embedding's layout: Qwen3ForCausalLM named, no LM head, last-token pooling, normalized."""
    return _embedding_copy(tiny_model_dirs["qwen3"], tmp_path_factory.mktemp("emb") / "qwen3", "lasttoken")


@pytest.fixture(scope="module")
def llama_mean(tiny_model_dir, tmp_path_factory) -> pathlib.Path:  # type: ignore[no-untyped-def]
    """A LlamaModel checkpoint (--runner auto serves it as embeddings) with mean pooling."""
    dst = tmp_path_factory.mktemp("emb") / "llama"
    return _embedding_copy(tiny_model_dir, dst, "mean", base_model_class=True)


def reference(
    model_dir: pathlib.Path, prompts: list[list[int]], pooling: str, normalize: bool
) -> list[torch.Tensor]:
    """transformers' base model (AutoModel: the decoder and its final norm) in float32, each prompt
    alone, pooled by hand."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # [T, H]
            vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling]
            out.append(torch.nn.functional.normalize(vector, dim=-1) if normalize else vector)
    return out


def _vectors(engine: LLMEngine, prompts: list[list[int]], params: PoolingParams) -> list[torch.Tensor]:
    outputs = engine.generate(prompts, params)
    assert all(o.finished and o.outputs == [] and o.embedding is not None for o in outputs)
    return [torch.tensor(o.embedding) for o in outputs]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert torch.allclose(g, w, atol=TOLERANCE, rtol=0), (g - w).abs().max()


def _assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


CASES = [  # (model fixture, --pooler-config, pooling, normalized by default)
    ("qwen3_embedding", None, "LAST", True),
    ("llama_mean", None, "MEAN", True),
    ("qwen3_embedding", '{"pooling_type": "CLS", "normalize": false}', "CLS", False),
    ("llama_mean", '{"normalize": false}', "MEAN", False),
]


@pytest.mark.parametrize(("model", "pooler_config", "pooling", "normalize"), CASES)
def test_vectors_equal_transformers_alone_batched_and_chunked(
    request: pytest.FixtureRequest, model: str, pooler_config: str | None, pooling: str, normalize: bool
) -> None:
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(5, 1024, seed=3, min_len=3, max_len=40)
    want = reference(model_dir, prompts, pooling, normalize)
    whole = make_engine(model_dir, runner="pooling", pooler_config=pooler_config)
    assert whole.runner_type == "pooling" and whole.embed.embedding_size == 64
    _assert_close([_vectors(whole, [p], PoolingParams())[0] for p in prompts], want)  # alone
    _assert_close(_vectors(whole, prompts, PoolingParams()), want)  # batched
    _assert_all_blocks_free(whole)
    # Chunks of 8 tokens: a prompt spans up to five steps (MEAN sums across them; CLS keeps its first).
    chunked = make_engine(model_dir, runner="pooling", pooler_config=pooler_config, max_num_batched_tokens=8)
    _assert_close(_vectors(chunked, prompts, PoolingParams()), want)
    _assert_all_blocks_free(chunked)
    # A request's own normalize wins over the pooler's.
    flipped = reference(model_dir, prompts[:2], pooling, not normalize)
    _assert_close(_vectors(whole, prompts[:2], PoolingParams(normalize=not normalize)), flipped)


def test_a_prefix_cache_hit_gives_the_same_last_token_vector(qwen3_embedding: pathlib.Path) -> None:
    engine = make_engine(qwen3_embedding, runner="pooling", block_size=4)
    assert engine.block_manager.enable_prefix_caching  # LAST: the cached positions are not needed
    shared = random_prompts(1, 1024, seed=5, min_len=24, max_len=24)[0]
    prompts = [shared, [*shared, 7, 8, 9]]
    want = reference(qwen3_embedding, prompts, "LAST", True)
    _assert_close(_vectors(engine, prompts[:1], PoolingParams()), want[:1])
    _assert_close(_vectors(engine, prompts[1:], PoolingParams()), want[1:])  # hits the first's blocks
    assert engine.stats().num_prefix_cache_hits_total >= 20
    _assert_close(_vectors(engine, prompts[:1], PoolingParams()), want[:1])  # its own blocks again


@pytest.mark.parametrize("pooler_config", [None, '{"pooling_type": "CLS"}'])
def test_mean_and_cls_pooling_turn_prefix_caching_off(
    llama_mean: pathlib.Path, pooler_config: str | None
) -> None:
    """A cached prefix's positions would be skipped: MEAN and CLS need their hidden states."""
    engine = make_engine(llama_mean, block_size=4, pooler_config=pooler_config)  # LlamaModel: auto
    assert engine.runner_type == "pooling" and not engine.block_manager.enable_prefix_caching
    shared = random_prompts(1, 1024, seed=5, min_len=24, max_len=24)[0]
    prompts = [shared, [*shared, 7, 8, 9]]
    pooling = "MEAN" if pooler_config is None else "CLS"
    got = [_vectors(engine, [p], PoolingParams())[0] for p in prompts]
    _assert_close(got, reference(llama_mean, prompts, pooling, True))


@pytest.mark.parametrize("model", ["qwen3_embedding", "llama_mean"])
def test_vectors_after_preemption(request: pytest.FixtureRequest, model: str) -> None:
    """A prompt preempted mid-way is recomputed from its start, its MEAN sum started afresh. The
    scheduler never needs to in pooling mode (only the last prompt a step admits is left partly
    computed; every other one ends that step), so the test preempts it itself."""
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(2, 1024, seed=11, min_len=30, max_len=40)
    engine = make_engine(model_dir, runner="pooling", max_num_batched_tokens=8, enable_prefix_caching=False)
    pooling = "LAST" if model == "qwen3_embedding" else "MEAN"
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PoolingParams())
    assert engine.step() == [] and engine.step() == []  # 16 tokens of the first prompt
    first = engine.requests["r0"].seqs[0]
    assert first.num_computed_tokens == 16
    engine.scheduler._preempt(first)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: torch.tensor(o.embedding) for o in engine.step()})
    assert first.num_preemptions == 1
    _assert_close([final["r0"], final["r1"]], reference(model_dir, prompts, pooling, True))
    _assert_all_blocks_free(engine)


def test_each_request_frees_its_blocks_the_step_its_vector_is_out(qwen3_embedding: pathlib.Path) -> None:
    engine = make_engine(qwen3_embedding, runner="pooling", enable_prefix_caching=False)
    engine.add_request("a", list(range(5, 40)), PoolingParams())
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["a"] and outputs[0].finished
    _assert_all_blocks_free(engine)
    assert not engine.has_unfinished_requests()
    assert engine.stats().finished_by_reason == {"stop": 1}
    assert engine.stats().num_prompt_tokens_total == 35


def test_an_abort_mid_prompt_frees_its_blocks(llama_mean: pathlib.Path) -> None:
    engine = make_engine(llama_mean, max_num_batched_tokens=8)
    engine.add_request("a", list(range(5, 40)), PoolingParams())
    assert engine.step() == []  # the first chunk of five
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    aborted = engine.abort_request("a")
    assert aborted is not None and aborted.finished and aborted.embedding is None
    _assert_all_blocks_free(engine)
    assert engine._pooling is not None and not engine._pooling.pooler._partial  # its sum dropped


def test_the_wrong_params_for_the_runner_are_refused(qwen3_embedding, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    pooling = make_engine(qwen3_embedding, runner="pooling")
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        pooling.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    generating = make_engine(tiny_model_dir)
    assert generating.runner_type == "generate"
    with pytest.raises(InvalidRequestError, match="--runner generate"):
        generating.add_request("a", [1, 2, 3], PoolingParams())


def test_a_prompt_may_fill_the_whole_context(qwen3_embedding: pathlib.Path) -> None:
    engine = make_engine(qwen3_embedding, runner="pooling", max_model_len=32)
    (out,) = engine.generate([list(range(3, 35))], PoolingParams())
    assert out.embedding is not None
    with pytest.raises(InvalidRequestError, match="maximum context length is 32"):
        engine.add_request("b", list(range(3, 36)), PoolingParams())


def test_dimensions_only_on_a_matryoshka_model(qwen3_embedding: pathlib.Path, tmp_path: pathlib.Path) -> None:
    engine = make_engine(qwen3_embedding, runner="pooling")
    with pytest.raises(InvalidRequestError, match="matryoshka") as refused:
        engine.add_request("a", [1, 2, 3], PoolingParams(dimensions=16))
    assert refused.value.param == "dimensions"
    model_dir = shutil.copytree(qwen3_embedding, tmp_path / "matryoshka")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    engine = make_engine(model_dir, runner="pooling")
    prompt = [5, 6, 7, 8, 9]
    (full,) = reference(model_dir, [prompt], "LAST", False)
    _assert_close(
        _vectors(engine, [prompt], PoolingParams(dimensions=16)),
        [torch.nn.functional.normalize(full[:16], dim=-1)],
    )
    with pytest.raises(InvalidRequestError, match=r"\[16, 32, 64\]"):
        engine.add_request("b", prompt, PoolingParams(dimensions=8))


def test_what_a_pooling_engine_refuses_at_start(qwen3_embedding, llama_mean) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelLoadError, match="--speculative"):
        LLMEngine(
            EngineArgs(model=str(qwen3_embedding), runner="pooling", speculative="ngram", num_kv_blocks=8)
        )
    with pytest.raises(ModelLoadError, match="without an LM head"):
        LLMEngine(EngineArgs(model=str(llama_mean), runner="generate", num_kv_blocks=8))
