"""The decoder's RMSNorm in its three roundings (Llama's, Gemma's (1 + weight), OLMo 2's float32
scale), and the pass-through that stands where a layout has no norm (OLMo 2's inputs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from corral_engine.model.native import FusedOps

if TYPE_CHECKING:
    from corral_engine.model.triton_ops import TritonOps  # imports triton: only where it is used


class RMSNorm(nn.Module):
    fused_ops: FusedOps | None = None  # the native bf16 ops, set by the runner where they built
    triton_ops: TritonOps | None = None  # the GPU's fused elementwise kernels, set by the runner

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, fp32_scale: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Gemma: scale by (1 + weight) in float32, rounded once at the end; no fused kernel does that.
        self.unit_offset = unit_offset
        # OLMo 2: scale by the weight in float32, rounded once at the end (Gemma's, without the 1).
        self.fp32_scale = fp32_scale or unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_scale:
            scale = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()
            return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).mul_(scale).to(x.dtype)
        triton_ops = self._triton(x)
        if triton_ops is not None:
            return triton_ops.rms_norm(x, self.weight, self.eps)  # one launch, not four
        ops = self._native(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)  # bf16 on the CPU: one pass over memory
        # Normalise in float32, scale in the model dtype: transformers' order, in one fused kernel.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual): the residual add and the norm after it."""
        ops = self._triton(x)
        if ops is not None:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        native = self._native(x, residual)
        if native is not None:
            return native.add_rms_norm(x, residual, self.weight, self.eps)  # one call, not two
        summed = x + residual
        return self(summed), summed

    def _native(self, *xs: torch.Tensor) -> FusedOps | None:
        ops = self.fused_ops
        usable = (
            ops is not None
            and not self.fp32_scale
            and self.weight.dtype == xs[0].dtype
            and all(ops.supports(x) for x in xs)
        )
        return ops if usable else None

    def _triton(self, x: torch.Tensor) -> TritonOps | None:
        ops = self.triton_ops
        usable = ops is not None and not self.fp32_scale and ops.supports(x) and self.weight.dtype == x.dtype
        return ops if usable else None


class NoNorm(nn.Module):
    """Where a layout has no norm (OLMo 2 before attention and the MLP): the input as it is, and
    RMSNorm's residual add without a norm after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return summed, summed
