"""Shared helpers for engine tests: reference greedy decodes from transformers, engine builders."""

from __future__ import annotations

import pathlib

import torch
from corral_engine import EngineArgs, SamplingParams
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.cuda_graphs import GraphCapture
from corral_engine.settings import EngineSettings

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def random_prompts(
    num: int, vocab: int, seed: int = 0, min_len: int = 1, max_len: int = 70
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def transformers_greedy(
    model_dir: pathlib.Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    # No EOS: the engine runs with ignore_eos, which keeps going past EOS without suppressing it.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=config,
            )
            out.append(ids[0, len(prompt) :].tolist())
            if len(out[-1]) != max_new_tokens:
                raise RuntimeError("transformers stopped early; the reference is unusable")
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
