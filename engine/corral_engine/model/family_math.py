"""The Granite, OLMo 2 and Gemma 2 departures from the Llama math (multipliers, post-norm layers,
soft-capping), read from config.json once, and the logit transforms they apply last."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral_engine.errors import ModelLoadError

if TYPE_CHECKING:  # model/config.py reads this module: the simulator's path imports no torch
    import torch

GRANITE = "GraniteForCausalLM"
OLMO2 = "Olmo2ForCausalLM"
GEMMA2 = "Gemma2ForCausalLM"
FAMILY_ARCHITECTURES = (GRANITE, OLMO2, GEMMA2)


@dataclass(frozen=True, slots=True)
class FamilyMath:
    """What a family computes beyond Llama's layers; None / False: Llama's way."""

    embedding_multiplier: float | None = None  # Granite: embeddings x this, in the model dtype
    residual_multiplier: float | None = None  # Granite: each sublayer's output x this before its add
    logits_scaling: float | None = None  # Granite: logits divided by this
    # OLMo 2: no norm before attention or the MLP, one after each (before the residual add), and
    # q/k RMSNorm over the whole projection (all heads at once), not per head.
    is_post_norm: bool = False
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)


def family_math(arch: str, hf: Any, where: Path) -> FamilyMath | None:
    """The family's math from its transformers config, checked; None for the other architectures."""
    if arch == GRANITE:
        return FamilyMath(
            embedding_multiplier=_positive(hf, "embedding_multiplier", where),
            residual_multiplier=_positive(hf, "residual_multiplier", where),
            logits_scaling=_positive(hf, "logits_scaling", where),
        )
    if arch == OLMO2:
        return FamilyMath(is_post_norm=True)
    if arch == GEMMA2:
        return FamilyMath(
            attn_logit_softcapping=_optional_cap(hf, "attn_logit_softcapping", where),
            final_logit_softcapping=_optional_cap(hf, "final_logit_softcapping", where),
        )
    return None


def final_logits(logits: torch.Tensor, math: FamilyMath | None) -> torch.Tensor:
    """[S, V] float32 logits after the family's last transform (in place); as given for the others."""
    if math is None:
        return logits
    if math.logits_scaling is not None:
        logits.div_(math.logits_scaling)
    cap = math.final_logit_softcapping
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    return logits


def _positive(hf: Any, field: str, where: Path) -> float:
    value = getattr(hf, field, None)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"{where}: {field} must be a positive number, got {value!r}")
    return float(value)


def _optional_cap(hf: Any, field: str, where: Path) -> float | None:
    return None if getattr(hf, field, None) is None else _positive(hf, field, where)
