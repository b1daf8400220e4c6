"""Reference greedy decodes from transformers, on any device: what the engine's output must equal.

Light on purpose (torch and transformers only) so any harness can import it; the engine tests
(tests/engine/helpers.py) use it too.
"""

from __future__ import annotations

import pathlib

import torch


def random_prompts(
    num: int, vocab: int, seed: int = 0, min_len: int = 1, max_len: int = 70
) -> list[list[int]]:
    """Seeded prompts of ids 3..vocab-1 (clear of the demo models' special ids 0-2)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def load_model(model_dir: pathlib.Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint as transformers builds it, on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    if device.type == "cuda":  # straight onto the card, not through host memory
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map=str(device))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


def transformers_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Each prompt alone (no padding), `max_new_tokens` greedy tokens, EOS ignored (the engine runs
    with ignore_eos, which keeps going past EOS without suppressing it)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(  # type: ignore[operator]
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                generation_config=config,
            )
            out.append(ids[0, len(prompt) :].tolist())
            if len(out[-1]) != max_new_tokens:
                raise RuntimeError("transformers stopped early; the reference is unusable")
    return out


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))
