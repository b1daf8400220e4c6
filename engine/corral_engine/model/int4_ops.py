"""The tensor work of integer weight-only checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized;
model/quant_formats.py reads their configs): packed int32 words unpacked to one value per weight,
cut for this rank, dequantized, or packed for PyTorch's int4 kernels; and the int4 matmul."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corral_engine.errors import ModelLoadError
from corral_engine.model.parallel import Cut

# Nibble i of an AWQ word holds output column 8c + AWQ_ORDER[i] (AutoAWQ's GEMM interleave).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The group sizes PyTorch's int4 kernels take (CPU and CUDA); a larger checkpoint group (or one
# group per row) runs as several of these sharing a scale.
KERNEL_GROUPS = (256, 128, 64, 32)
# The kernels' rule: w = (q - 8) * scale + zero, so a checkpoint zero z becomes (8 - z) * scale.
KERNEL_OFFSET = 8


@dataclass(slots=True)
class IntWeight:
    """One checkpoint module's weight unpacked: q [out, in] uint8 (unsigned values), scale and zero
    [out, groups] float32 (zero on q's unsigned scale), group [in] int64: each input column's group."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """w [out, in] float32 = (q - zero) * scale of each column's group."""
        return (self.q.float() - self.zero[:, self.group]) * self.scale[:, self.group]

    def cut(self, cut: Cut | list[Cut] | None) -> IntWeight:
        """This rank's part: output rows (dim 0; several pieces concatenated) or input columns
        (dim 1, every group kept: `contiguous_groups` picks this slice's)."""
        if cut is None:
            return self
        pieces = cut if isinstance(cut, list) else [cut]
        if pieces[0][0] == 1:
            _, start, length = pieces[0]
            end = start + length
            return IntWeight(self.q[:, start:end], self.scale, self.zero, self.group[start:end])
        rows = torch.cat([torch.arange(start, start + length) for _, start, length in pieces])
        return IntWeight(self.q[rows], self.scale[rows], self.zero[rows], self.group)

    def contiguous_groups(self, group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale, zero) [out, in / group_size] when every column's group is whole and in order
        (column j in group first + j // group_size), else None (act-order, or a cut mid-group)."""
        cols = self.q.shape[1]
        if group_size <= 0 or cols % group_size:
            return None
        first = int(self.group[0])
        expected = first + torch.arange(cols) // group_size
        if not torch.equal(self.group, expected):
            return None
        end = first + cols // group_size
        if end > self.scale.shape[1]:
            return None
        return self.scale[:, first:end], self.zero[:, first:end]


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words packed along `dim` (value i of a word in bits [i*bits, (i+1)*bits)) -> one
    uint8 value each, that dim 32/bits times longer."""
    per_word = 32 // bits
    moved = words.transpose(0, 1) if dim == 0 else words  # [R, W]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    flat = values.reshape(moved.shape[0], moved.shape[1] * per_word).to(torch.uint8)
    return flat.transpose(0, 1) if dim == 0 else flat


def _groups(num_cols: int, group_size: int) -> torch.Tensor:
    return torch.arange(num_cols) // (num_cols if group_size == -1 else group_size)


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> IntWeight:
    """AWQ GEMM: qweight [in, out/8] and qzeros [in/G, out/8] packed along out in AWQ_ORDER,
    scales [in/G, out]."""
    inverse = [AWQ_ORDER.index(j) for j in range(8)]  # output column j sits in nibble inverse[j]

    def along_out(words: torch.Tensor) -> torch.Tensor:  # [R, out/8] -> [R, out]
        nibbles = unpack_words(words, 4, 1).reshape(words.shape[0], -1, 8)
        return nibbles[:, :, inverse].reshape(words.shape[0], -1)

    q = along_out(qweight).t().contiguous()  # [out, in]
    zero = along_out(qzeros).t().float()  # [out, in/G]
    return IntWeight(q, scales.t().float(), zero, _groups(q.shape[1], group_size))


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    zeros_minus_one: bool,
) -> IntWeight:
    """GPTQ: qweight [in*bits/32, out] packed along in, qzeros [in/G, out*bits/32] packed along
    out (v1 stores z - 1), scales [in/G, out], g_idx [in] each input row's group."""
    q = unpack_words(qweight, bits, 0).t().contiguous()  # [out, in]
    zero = unpack_words(qzeros, bits, 1).t().float()[: q.shape[0]]  # [out, in/G]
    if zeros_minus_one:
        zero = zero + 1
    num_groups = scales.shape[0]
    group = _groups(q.shape[1], q.shape[1] // num_groups) if g_idx is None else g_idx.long()
    if int(group.max()) >= num_groups or int(group.min()) < 0:
        raise ModelLoadError(f"GPTQ g_idx names group {int(group.max())}; the scales have {num_groups}")
    return IntWeight(q, scales.t().float(), zero, group)


def unpack_compressed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
) -> IntWeight:
    """compressed-tensors pack-quantized: weight_packed [out, ceil(in*bits/32)] packed along in,
    signed values stored + 2^(bits-1); weight_scale [out, groups]; an asymmetric checkpoint's
    weight_zero_point packed along out, stored the same way."""
    out, cols = shape
    q = unpack_words(packed, bits, 1)[:, :cols].contiguous()
    num_groups = scale.shape[1]
    if zero_point is None:
        zero = torch.full((out, num_groups), float(1 << (bits - 1)))
    else:
        zero = unpack_words(zero_point, bits, 0)[:out].float()
    group = _groups(cols, cols // num_groups) if g_idx is None else g_idx.long()
    return IntWeight(q, scale.float(), zero, group)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> uint8 [N, K/2]: column 2k in the high nibble, 2k+1 in the low
    (the layout CUDA's _convert_weight_to_int4pack reads)."""
    q = q.to(torch.uint8)
    return (q[:, ::2] << 4) | q[:, 1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: uint8 [N, K/2] -> [N, K] uint8."""
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(packed.shape[0], -1)


def kernel_group(group_size: int) -> int | None:
    """The largest group size the int4 kernels take that divides `group_size` (None: none does)."""
    return next((g for g in KERNEL_GROUPS if group_size % g == 0), None)


def int4_fits(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether the int4 kernels take a layer of this shape (its groups whole; N a multiple of 16:
    the CPU kernel's rule, stricter than tinygemm's 8)."""
    group = in_features if group_size == -1 else group_size
    return in_features % group == 0 and out_features % 16 == 0 and kernel_group(group) is not None


def _inner_k_tiles(in_features: int) -> int:
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def pack_for_kernel(
    nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A layer's nibbles [N, K/2], scale and zero [N, K/G] -> (the kernel's packed weight, its
    group size, scales_and_zeros [K/g, N, 2] in the activations' `dtype`)."""
    group = kernel_group(group_size)
    if group is None:
        raise ValueError(f"no int4 kernel group size divides {group_size}")
    repeat = group_size // group
    s = scale.repeat_interleave(repeat, dim=1)  # [N, K/g]
    z = zero.repeat_interleave(repeat, dim=1)
    scales_and_zeros = torch.stack([s.t(), ((KERNEL_OFFSET - z) * s).t()], dim=-1).to(dtype).contiguous()
    if nibbles.device.type == "cuda":
        in_features = nibbles.shape[1] * 2
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), _inner_k_tiles(in_features))
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_nibbles(nibbles).to(torch.int32), 1
        )
    return packed, group, scales_and_zeros


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    group: int,
    scales_and_zeros: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [T, in] @ w^T with w held by the int4 kernel (pack_for_kernel), output in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    num_out = scales_and_zeros.shape[1]
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], num_out))
    if x2.device.type == "cuda":
        out = torch.ops.aten._weight_int4pack_mm(x2, packed, group, scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scales_and_zeros)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], num_out)


def has_int4_kernel(device: torch.device) -> bool:
    """Whether PyTorch's int4 kernel runs on `device` with bfloat16 activations (CUDA: tinygemm
    needs sm80+ and a build that has it)."""
    try:
        q = torch.zeros((16, 64), dtype=torch.uint8, device=device)
        ones = torch.ones((16, 2), device=device)
        packed, group, sz = pack_for_kernel(pack_nibbles(q), ones, ones, 32, torch.bfloat16)
        int4_linear(torch.ones((1, 64), dtype=torch.bfloat16, device=device), packed, group, sz, None)
    except (RuntimeError, NotImplementedError):
        return False
    return True
