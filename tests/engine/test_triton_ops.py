"""The fused elementwise Triton kernels (model/triton_ops.py) against the PyTorch expressions they
replace, run on CPU through Triton's interpreter (and compiled on CUDA where there is a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from corral_engine.model.rotary import rotate_half
from corral_engine.model.triton_ops import TritonOps

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPS = TritonOps()


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward's PyTorch path."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, device: str) -> None:
    """float32: float32 rounding apart (reductions in another order). bfloat16: a few ulps apart on
    the CPU, where the interpreter rounds every float32 to bfloat16 toward zero (a wrong half, sign
    or scale is off by far more)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
    elif device == "cpu":
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-5, atol=2**-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [64, 96])  # 96: a row narrower than its power-of-two block
def test_rms_norm_matches_pytorch(device: str, dtype: torch.dtype, size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, size, generator=gen) * 3).to(device, dtype)
    weight = (torch.rand(size, generator=gen) + 0.5).to(device, dtype)
    assert_close(OPS.rms_norm(x, weight, 1e-5), reference_norm(x, weight, 1e-5), device)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_of_heads_reads_a_strided_view(device: str) -> None:
    """Qwen3's q/k norm: [T, H, D] views of the fused QKV rows, normalised per head."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 7 * 32, generator=gen).to(device)
    q = qkv[:, : 4 * 32].view(4, 4, 32)
    weight = (torch.rand(32, generator=gen) + 0.5).to(device)
    out = OPS.rms_norm(q, weight, 1e-6)
    assert out.is_contiguous()
    assert_close(out, reference_norm(q, weight, 1e-6), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_returns_the_norm_and_the_sum(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 80, generator=gen).to(device, dtype)
    residual = torch.randn(6, 80, generator=gen).to(device, dtype)
    weight = (torch.rand(80, generator=gen) + 0.5).to(device, dtype)
    normed, summed = OPS.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(summed, x + residual, device)
    assert_close(normed, reference_norm(summed, weight, 1e-5), device)
    if dtype == torch.float32:
        assert torch.equal(summed, x + residual)  # one float32 add, the same everywhere


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_pytorch_on_qkv_views(device: str, dtype: torch.dtype) -> None:
    """q and k are views of the fused QKV rows (GQA: 4 query heads, 2 KV heads); v is untouched."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 6
    cos = torch.cat((angles, angles), dim=-1).cos().to(device, dtype)
    sin = torch.cat((angles, angles), dim=-1).sin().to(device, dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    want_q = q * cos + rotate_half(q) * sin
    want_k = k * cos + rotate_half(k) * sin
    OPS.rotary(q, k, cos, sin)
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(q, want_q) and torch.equal(k, want_k)  # the same roundings, op for op
    else:
        assert_close(q.contiguous(), want_q, device)
        assert_close(k.contiguous(), want_k, device)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [48, 1500])  # 1500: two column blocks, the last partial
def test_silu_and_mul_matches_pytorch(device: str, dtype: torch.dtype, size: int) -> None:
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 2 * size, generator=gen) * 4).to(device, dtype)
    want = F.silu(gate_up[:, :size]) * gate_up[:, size:]
    assert_close(OPS.silu_and_mul(gate_up), want, device)


def test_empty_batches_launch_nothing() -> None:
    empty = torch.empty(0, 32)
    weight = torch.ones(32)
    assert OPS.rms_norm(empty, weight, 1e-5).shape == (0, 32)
    assert OPS.add_rms_norm(empty, empty, weight, 1e-5)[1].shape == (0, 32)
    assert OPS.silu_and_mul(torch.empty(0, 64)).shape == (0, 32)
    OPS.rotary(torch.empty(0, 2, 8), torch.empty(0, 1, 8), torch.empty(0, 1, 8), torch.empty(0, 1, 8))
