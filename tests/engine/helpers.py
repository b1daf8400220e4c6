"""Shared helpers for engine tests: reference greedy decodes from transformers, engine builders."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from corral_engine import EngineArgs, SamplingParams
from corral_engine.llm_engine import LLMEngine
from corral_engine.lora import LoraRequest
from corral_engine.model.cuda_graphs import GraphCapture
from corral_engine.settings import EngineSettings

from bench.gpu import reference
from bench.gpu.reference import random_prompts

__all__ = [
    "GREEDY",
    "ODD_MODEL_OVERRIDES",
    "UNIT_ROUNDOFF",
    "check_linear_contract",
    "cpu_has",
    "make_engine",
    "peft_greedy",
    "random_prompts",
    "run_checked",
    "transformers_greedy",
]

# bf16 keeps 8 significant bits, so one rounding to nearest is off by at most u = 2^-8 (relative).
UNIT_ROUNDOFF = 2.0**-8
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# The tiny Llama made awkward for two ranks: one KV head (replicated), biases on every projection
# (o_proj's and down_proj's added by rank 0 alone), tied embeddings, a vocabulary split unevenly.
ODD_MODEL_OVERRIDES = {
    "num_key_value_heads": 1,
    "attention_bias": True,
    "mlp_bias": True,
    "tie_word_embeddings": True,
    "vocab_size": 1023,
}


def transformers_greedy(
    model_dir: pathlib.Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy output in float32 on the CPU (bench/gpu/reference.py, shared with the
    GPU acceptance run)."""
    model = reference.load_model(model_dir, torch.device("cpu"), torch.float32)
    return reference.transformers_greedy(model, prompts, max_new_tokens)


def peft_greedy(
    model_dir: pathlib.Path, adapter: pathlib.Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' (with peft's adapter) greedy tokens, one prompt at a time, in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                min_new_tokens=max_new_tokens,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


def make_engine(
    model_dir: pathlib.Path,
    settings: EngineSettings | None = None,
    graph_capture: GraphCapture | None = None,
    **kwargs: object,
) -> LLMEngine:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_kv_blocks", 256)
    args = EngineArgs(model=str(model_dir), **kwargs)  # type: ignore[arg-type]
    return LLMEngine(args, settings, graph_capture)


def run_checked(engine: LLMEngine) -> dict[str, list[int]]:
    """Step to completion, checking block accounting after every step; final token ids per request."""
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants(engine.live_sequences())
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return final


def generate_in_order(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, lora: LoraRequest | None = None
) -> list[list[int]]:
    """Each prompt's final token ids, in `prompts`' order (requests r0, r1, ...; run_checked)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, lora=lora)
    final = run_checked(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]


def cached_and_generated(engine: LLMEngine, prompt: Any, params: SamplingParams) -> tuple[int, list[int]]:
    """One request's prompt tokens read from the prefix cache, and its output token ids."""
    engine.add_request("q", prompt, params)
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final["q"].metrics.num_cached_tokens, final["q"].outputs[0].token_ids


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` for this CPU (False where it cannot be read)."""
    try:
        return any(flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def check_linear_contract(
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    rows: int,
    size: int,
    out: int,
    bias: bool,
) -> None:
    """linear(x, weight, bias) is one rounding of a float32 sum: within bf16's rounding of the
    exact product, plus what summing `size` float32 terms in any order can add (size * 2^-24 of
    the sum of |terms|)."""
    gen = torch.Generator().manual_seed(rows * size)
    x = torch.randn(rows, size, generator=gen).bfloat16()
    weight = (torch.randn(out, size, generator=gen) / 8).bfloat16()
    b = (torch.randn(out, generator=gen) / 4).bfloat16() if bias else None
    got = linear(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
    bound = UNIT_ROUNDOFF * exact.abs() + (size + 1) * 2.0**-24 * magnitude * (1 + UNIT_ROUNDOFF)
    assert bool(((got.double() - exact).abs() <= bound).all())
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=2e-2, rtol=2e-2)  # PyTorch's own
