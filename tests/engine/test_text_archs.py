"""Granite, OLMo 2 and Gemma 2 beyond the shared greedy equality (test_engine_matches_transformers.py):
their logits, which greedy tokens cannot check (Granite's logits_scaling and Gemma 2's final
soft-cap keep the top token), the native backend refused for Gemma 2's soft-capped scores, and
what the native decode stack and tensor parallelism do not take."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import pytest
import torch
from corral_engine.errors import ModelLoadError
from corral_engine.model.attention import choose_attention_backend
from corral_engine.model.decode_stack import unsupported
from corral_engine.sampling_params import SamplingParams

from bench.gpu import reference
from tests.engine.helpers import make_engine, random_prompts

ARCHS = ["granite", "olmo2", "gemma2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers(arch: str, tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    """Every prompt token's logprob as transformers' logits give it, whole and in chunks of 7
    tokens (the 40-token prompt passes Gemma 2's 16-token window)."""
    model_dir = tiny_model_dirs[arch]
    (prompt,) = random_prompts(1, 500, seed=51, min_len=40, max_len=40)
    model = reference.load_model(model_dir, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)
    for chunk in (512, 7):
        engine = make_engine(model_dir, max_num_batched_tokens=chunk)
        engine.add_request("r", prompt, params)
        final = None
        while engine.has_unfinished_requests():
            final = next((out for out in engine.step() if out.finished), final)
        assert final is not None and final.prompt_logprobs is not None
        for q, item in enumerate(final.prompt_logprobs[1:], start=1):
            assert item is not None and abs(item.logprob - float(ref[q - 1, prompt[q]])) < 1e-4
            assert [t for t, _ in item.top] == torch.topk(ref[q - 1], 3).indices.tolist()


def test_soft_capping_refuses_the_native_backend(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    """The native kernels cannot cap scores: asked for, a start-up error that says so; on auto, the
    CPU takes sdpa for Gemma 2 (native for the others)."""
    assert choose_attention_backend("auto", "cpu", True, False, has_softcap=True) == "sdpa"
    assert choose_attention_backend("auto", "cuda", False, False, has_softcap=True) == "triton"
    assert choose_attention_backend("triton", "cpu", True, True, has_softcap=True) == "triton"
    with pytest.raises(ModelLoadError, match="cannot soft-cap attention scores"):
        make_engine(tiny_model_dirs["gemma2"], attention_backend="native")
    assert make_engine(tiny_model_dirs["gemma2"]).runner.attention_backend == "sdpa"


@pytest.mark.parametrize("arch", ["granite", "olmo2"])
def test_the_native_decode_stack_leaves_them_to_the_layers(
    arch: str, tiny_model_dirs: Mapping[str, pathlib.Path]
) -> None:
    """The C decoder computes Llama's layers: no multipliers, no post-norms (bf16 on the CPU, where
    it would otherwise run)."""
    engine = make_engine(tiny_model_dirs[arch], dtype="bfloat16", block_size=8)
    assert engine.runner.model.decode_stack is None
    assert "ForCausalLM's layers" in unsupported(engine.runner.model, engine.runner.kv_caches)


def test_olmo2_on_two_ranks_is_refused(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    with pytest.raises(ModelLoadError, match="OLMo 2"):
        make_engine(tiny_model_dirs["olmo2"], tensor_parallel_size=2)
