"""Rotary position embeddings from a checkpoint's rope parameters: the scaling types through
transformers' own init functions, LongRoPE's factor set chosen once for the engine's context,
partial rotary (a head's leading dims only) and one table per parameter set (Gemma 3's local and
global layers)."""

from __future__ import annotations

import torch
from torch import nn

from corral_engine.model.config import ModelConfig


class Rotary(nn.Module):
    """cos/sin tables for one of the checkpoint's rope parameter sets (`kind`; None: its only one)."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] float32

    def __init__(
        self, config: ModelConfig, kind: str | None = None, max_model_len: int | None = None
    ) -> None:
        super().__init__()
        self.kind = kind
        inv_freq, self.attention_scaling = rope_parameters(config, kind, max_model_len)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, R]


def rope_parameters(
    config: ModelConfig, kind: str | None = None, max_model_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, the cos/sin scaling) for parameter set `kind`.

    LongRoPE (Phi-3.5, Phi-4-mini) has a short and a long factor list; transformers picks per
    forward call by the sequence's length, which would rotate one sequence's cached keys two ways.
    As vLLM does, the engine picks once: the long factors when `max_model_len` exceeds
    original_max_position_embeddings, else the short ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = config.hf_config
    params = getattr(hf, "rope_parameters", None) or {}
    if kind is not None:
        params = params.get(kind) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling is not supported (it depends on the batch's length)")
    if rope_type != "default":
        kwargs: dict[str, object] = {} if kind is None else {"layer_type": kind}
        if rope_type == "longrope":
            kwargs["seq_len"] = max_model_len
        with torch.device("cpu"):  # the model may be under construction on the meta device
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **kwargs)
        return inv_freq, float(scaling)
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    return inv_freq, 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with its leading cos.shape[-1] dims rotated (all of them unless partial rotary)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :dim], x[..., dim:]
    return torch.cat((head * cos + rotate_half(head) * sin, rest), dim=-1)
