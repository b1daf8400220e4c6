"""Triton kernels for the model's elementwise work on GPUs: RMSNorm with the residual add before it,
rotary embedding of q and k in place, and SiLU-and-multiply. Each is one launch where the PyTorch
expressions it replaces take several (RMSNorm alone: upcast, norm, downcast, scale), and on a GPU
at small batches those short kernels, not the weight reads, are what a decode step waits on
(docs/engine-speed.md, "where a GPU step's time goes").

Each kernel rounds where the expression it replaces rounds (to the model dtype after every PyTorch
op, computing in float32 in between), so outputs match PyTorch's bit for bit except where float32
reductions or exp differ in their last bit. They run on CPU tensors through Triton's interpreter
(compiled per mode, as in triton_attention), slowly, for tests; the interpreter rounds float32 to
bfloat16 toward zero, one bf16 ulp off where a GPU rounds to nearest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corral_engine.model.triton_attention import launcher

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonOps:
    """The elementwise ops the model's modules call when the runner gives them these (on CUDA)."""

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.dtype in _DTYPES and x.stride(-1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * rms_norm(float32(x)).to(dtype) over the last dimension, for x of [T, N] or
        [T, H, N] (any strides but the last)."""
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _norm(x, None, weight, out, None, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual) for x and residual of [T, N], in one pass."""
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _norm(x, residual, weight, out, summed, eps)
        return out, summed

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place: x * cos + rotate_half(x) * sin for q [T, H, D] and k [T, KVH, D] (views of
        the fused QKV rows are fine), with cos and sin of [T, 1, D]."""
        num_tokens, num_heads, head_dim = q.shape
        if num_tokens == 0:
            return
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError("rotary needs cos and sin with equal strides, unit in the last dimension")
        half = head_dim // 2
        launcher(_rotary_kernel, q.device)[(num_tokens, num_heads + k.shape[1])](
            q, k, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            num_heads,
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            num_warps=1,
        )  # fmt: skip

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> [T, I]: silu(gate) * up, as `F.silu(x[:, :I]) * x[:, I:]` rounds it."""
        rows, width = gate_up.shape
        size = width // 2
        out = gate_up.new_empty((rows, size))
        if rows == 0:
            return out
        block = min(1024, triton.next_power_of_2(size))
        launcher(_silu_and_mul_kernel, gate_up.device)[(rows, triton.cdiv(size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block, num_warps=4
        )
        return out


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    summed: torch.Tensor | None,
    eps: float,
) -> None:
    size = x.shape[-1]
    if x.numel() == 0:
        return
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm needs unit stride in the last dimension")
    rows, heads = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    inner_x = x.stride(1) if x.dim() == 3 else 0
    inner_out = out.stride(1) if x.dim() == 3 else 0
    res = residual if residual is not None else x
    res_out = summed if summed is not None else out
    block = triton.next_power_of_2(size)
    launcher(_norm_kernel, x.device)[(rows, heads)](
        x, res, weight, out, res_out,
        x.stride(0), inner_x, res.stride(0), out.stride(0), inner_out, res_out.stride(0),
        size, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip


def _norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_xh, stride_r, stride_o, stride_oh, stride_ro,
    size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per row (and head): optionally x + residual (rounded, stored), then its RMSNorm
    in float32, rounded, times the weight, rounded."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < size
    x = tl.load(x_ptr + row * stride_x + head * stride_xh + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / size
    normed = (xf * tl.math.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_o + head * stride_oh + offs, y, mask=mask)


def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    num_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """One program per token and head (q's heads, then k's): the two halves of the head rotated,
    each product and the sum rounded to the model dtype as PyTorch's three ops round them."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_heads:
        base = q_ptr + token * stride_qt + head.to(tl.int64) * stride_qh
    else:
        base = k_ptr + token * stride_kt + (head - num_heads).to(tl.int64) * stride_kh
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + token * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + offs, o1, mask=mask)
    tl.store(base + HALF + offs, o2, mask=mask)


def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr):
    """Program (row, block): silu(gate) rounded, times up, rounded."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + size + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + offs, y, mask=mask)
