"""The tensor work of weight quantization (model/quant.py decides): checkpoint fp8 weights
dequantized, weights quantized per output row, and the quantized layers' matmuls."""

from __future__ import annotations

import torch

from corral_engine.errors import ModelLoadError
from corral_engine.model.parallel import Cut

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
INT8_MAX = 127.0  # symmetric: -128 is never used, so q and -q are both representable
WEIGHT_DTYPES = {"int8": torch.int8, "fp8": FP8}
CHECKPOINT_DTYPES = (torch.float8_e4m3fn,)


def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] (any float dtype) -> (q [R, C] int8 or float8_e4m3fn, scale [R] float32) with
    q * scale[:, None] ~ w; an all-zero row gets scale 1 and zeros."""
    w = w.float()
    amax = w.abs().amax(dim=1)  # [R]
    top = INT8_MAX if dtype == torch.int8 else FP8_MAX
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    scaled = (w / scale[:, None]).clamp(-top, top)
    q = scaled.round().to(torch.int8) if dtype == torch.int8 else scaled.to(FP8)
    return q, scale


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | None,
    cut: Cut | None,
    name: str,
) -> torch.Tensor:
    """A checkpoint's fp8 tensor `q` [R, C] (or this rank's slice `cut` of it) times its scale: one
    per tensor, per row ([rows] or [rows, 1]) or per block ([ceil(rows/b0), ceil(cols/b1)]) -> float32,
    computed as transformers does (the float32 product), so the result equals its dequantization."""
    rows, cols = q.shape
    r0 = cut[1] if cut is not None and cut[0] == 0 else 0
    c0 = cut[1] if cut is not None and cut[0] == 1 else 0
    s = scale.float()
    if s.numel() == 1:
        return q.float() * s.reshape(())
    if block_size is None:  # per output row
        if (s.dim() == 2 and s.shape[1] != 1) or s.shape[0] < r0 + rows:
            raise ModelLoadError(f"{name}: scale of shape {tuple(scale.shape)} does not fit {rows} rows")
        return q.float() * s.reshape(-1)[r0 : r0 + rows, None]
    row_blocks = torch.arange(r0, r0 + rows) // block_size[0]  # [R]
    col_blocks = torch.arange(c0, c0 + cols) // block_size[1]  # [C]
    if s.dim() != 2 or s.shape[0] <= int(row_blocks[-1]) or s.shape[1] <= int(col_blocks[-1]):
        raise ModelLoadError(
            f"{name}: block scale of shape {tuple(scale.shape)} does not cover "
            f"the weight in blocks of {block_size}"
        )
    return q.float() * s[row_blocks][:, col_blocks]  # [R, C]


def has_int8_kernel(device: torch.device) -> bool:
    """Whether torch._weight_int8pack_mm runs on `device` (CPU: yes; CUDA: PyTorch-build dependent)."""
    try:
        x = torch.ones((1, 32), dtype=torch.bfloat16, device=device)
        w = torch.ones((16, 32), dtype=torch.int8, device=device)
        torch._weight_int8pack_mm(x, w, torch.ones(16, dtype=torch.bfloat16, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def int8_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [T, in] @ (w [out, in] int8 * scale [out])^T, scale in x's dtype (the kernel's rule)."""
    out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), w, scale)  # [T, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], -1)


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [T, in] quantized to fp8 with a scale per token, times w [out, in] fp8 with `scale` [1, out]
    float32 per output row, accumulated by torch._scaled_mm into x's dtype (vLLM's dynamic fp8)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], w.shape[0]))
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [T, 1]
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scale, bias=bias, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], -1)
