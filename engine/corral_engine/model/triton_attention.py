"""Triton kernels for the paged KV cache: `write_kv` stores a step's new K/V rows in their slots, and
`unified_attention` attends a whole mixed batch (prompt chunks, prefix-cache hits, decodes,
speculative verify rows) in one launch, reading every key through the block tables. This module
sizes and launches them; their bodies are in model/triton_attention_kernels.py.

Tiling: a program owns one KV head and BLOCK_Q consecutive queries of one sequence. Its BLOCK_M
rows are those queries times the `group` query heads that share the KV head (GQA with no K/V
repeat), padded with masked rows to a power of two >= 16, tl.dot's smallest M on GPUs; head dims
are padded to a power of two the same way. Keys go by in tiles of TILE_N positions, each position's
block looked up in the block table, under an online softmax accumulated in float32; key tiles past
the tile's last query or before its sliding window are never visited. Causal masks align
bottom-right: query j of a sequence with n queries sits at position seq_len - n + j.

Grid: (T // BLOCK_Q + S, KVH, splits). Sequence i's query tiles are numbered from
query_start_loc[i] // BLOCK_Q + i, which leaves room for all of sequence i - 1's tiles; a program
binary-searches query_start_loc for its sequence and returns at once when it has no tile there.
When that grid is too small to fill a GPU (decoding a few long sequences), each tile's keys are
split across up to 16 programs that write float32 partials, merged by a second kernel. The grids
depend only on shapes and host ints (T, S, KVH, max_query_len through BLOCK_Q), so a captured CUDA
graph replays them with other lengths and block tables.

Running on CPU: the kernels are plain functions, compiled per mode on first use: a JITFunction for
GPU tensors, Triton's InterpretedFunction for CPU tensors (no TRITON_INTERPRET needed, whatever the
import order). Under the INTERPRET flag the kernels avoid two interpreter gaps of Triton 3.9:
tl.dot on bfloat16 operands returns garbage (the operands are upcast to float32; GPUs dot in the
cache dtype), and the standard library's jit functions (tl.max, tl.sum, tl.zeros, tl.cdiv) cannot
be called unless TRITON_INTERPRET was set at import (the reductions are spelled with tl.reduce and
the combine functions the interpreter recognises). The interpreter also rounds float32 to bfloat16
toward zero, one bf16 ulp off where a GPU rounds to nearest.

An fp8 cache (--kv-cache-dtype): `write_kv` clamps each new row to the format's finite range in
float32 and stores it as fp8; the attention kernel converts each K/V tile it loads to the queries'
dtype, so its dots run as for a cache in the model's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from corral_engine.model.triton_attention_kernels import _attention_kernel, _merge_kernel, _write_kv_kernel

_MAX_BLOCK_M = 64  # query rows (queries x heads of a group) per program, before padding to 16
_TARGET_PROGRAMS = 256  # attention programs that fill a large GPU (an H100 has 132 SMs) twice over
_MAX_SPLITS = 16
_LOG2_E = 1.4426950408889634


def write_kv(
    k: torch.Tensor,  # [T, KVH, D], unit stride in D
    v: torch.Tensor,  # [T, KVH, D], unit stride in D
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], contiguous
    slot_mapping: torch.Tensor,  # [T] int32 or int64: block * block_size + offset; < 0 skips the row
) -> None:
    """Stores each new token's K and V rows in its cache slot; negative slots (padding) are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_unit_stride(k, v, slot_mapping)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous K/V caches")
    # An fp8 cache's format: its largest finite value (the kernel saturates there), its mantissa
    # bits and smallest normal exponent (the interpreter's rounding); 0, 0, 0: the model's dtype.
    fp8 = torch.finfo(k_cache.dtype) if k_cache.dtype != k.dtype else None
    launcher(_write_kv_kernel, k.device)[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        FP8_MAX=0.0 if fp8 is None else fp8.max,
        FP8_MANTISSA=0 if fp8 is None else round(-math.log2(fp8.eps)),
        FP8_MIN_EXP=0 if fp8 is None else round(math.log2(fp8.smallest_normal)),
        INTERPRET=k.device.type == "cpu",
        KV_HEADS=num_kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip


def unified_attention(
    q: torch.Tensor,  # [T, H, D], unit stride in D
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], unit stride in D
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], strides equal to k_cache's
    out: torch.Tensor,  # [T, H, D], unit stride in D; rows of padded sequences are left untouched
    query_start_loc: torch.Tensor,  # [S + 1] int32: sequence i's rows are [qsl[i], qsl[i + 1])
    seq_lens: torch.Tensor,  # [S] int32: context after this step (cached + new); 0 = padding
    block_tables: torch.Tensor,  # [S, max_blocks] int32; entries past a context are stale, unread
    scale: float,
    window: int | None,  # query at position p sees keys k with p - k < window (None: all)
    max_query_len: int,  # host bound on queries per sequence: a tile-size hint, never a limit
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2); None: not
) -> None:
    """out rows of sequence i = softmax(q K^T * scale) V over its context read through its block
    table (bottom-right causal, GQA by head // group, optional window, optional soft-capping of
    the scores); one launch per batch."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} KV heads")
    _check_unit_stride(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables)
    if v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches need equal strides")
    row_bytes = _head_dim_pad(q.shape[2]) * q.element_size()
    _, num_splits = launch_shape(
        num_heads // num_kv_heads, num_kv_heads, row_bytes, max_query_len, num_tokens, seq_lens.shape[0],
        compiled=q.device.type != "cpu",
    )  # fmt: skip
    args = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, window)
    _attention(*args, max_query_len, num_splits, softcap)


def launch_shape(
    group: int,
    num_kv_heads: int,
    row_bytes: int,
    max_query_len: int,
    num_tokens: int,
    num_seqs: int,
    compiled: bool,
) -> tuple[int, int]:
    """(BLOCK_Q, NUM_SPLITS) of a batch: with the head shape, the constexprs that pick the
    compiled variant. The interpreter (`compiled` False) runs programs one after another:
    splitting would only add programs."""
    block_q, _, _ = _tile_sizes(group, max_query_len, row_bytes)
    num_programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    return block_q, _num_splits(num_programs) if compiled else 1


def warmup_shapes(group: int, num_kv_heads: int, row_bytes: int) -> list[tuple[int, int]]:
    """Every (BLOCK_Q, NUM_SPLITS) a batch can launch on a GPU: the BLOCK_Q of each power-of-two
    query length (the tile is capped at what fits, 9 queries for a group of 7), with each split
    count up to the smallest grid's (one sequence shorter than its tile: one row of programs)."""
    block_qs = sorted({_tile_sizes(group, 1 << i, row_bytes)[0] for i in range(21)})
    most_splits = _num_splits(num_kv_heads)
    splits = [1 << i for i in range(most_splits.bit_length())]
    return [(b, s) for b in block_qs for s in splits]


def warm_up(
    q_like: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> int:
    """Compile every attention variant a batch can launch (`warmup_shapes`) before serving, with
    one small launch each that reads block 0 of the cache into a scratch output; `q_like` gives
    the query heads, head dim and dtype ([*, H, D]). Triton compiles a variant on its first
    launch: left to serving, that is a stall of up to seconds inside some request's first
    token. Returns how many launches ran."""
    num_heads, head_dim = q_like.shape[1], q_like.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    row_bytes = _head_dim_pad(head_dim) * q_like.element_size()
    device = q_like.device
    shapes = warmup_shapes(group, num_kv_heads, row_bytes)
    for block_q, num_splits in shapes:
        q = torch.zeros((block_q, num_heads, head_dim), dtype=q_like.dtype, device=device)
        out = torch.empty_like(q)
        query_start_loc = torch.tensor([0, block_q], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([block_q], dtype=torch.int32, device=device)
        block_tables = torch.zeros((1, -(-block_q // block_size)), dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, window)
        _attention(*args, block_q, num_splits, softcap)
    return len(shapes)


def _tile_sizes(group: int, max_query_len: int, row_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, TILE_N). Decode-only batches take one query per tile (the rows are the
    group's heads); longer chunks take as many queries as fit _MAX_BLOCK_M rows. Wide K/V rows
    (`row_bytes`: padded head dim x element size) take smaller tiles, so the pipelined K/V tiles
    stay under 100 KB of shared memory (fp32 with head dim 128: 96 KB)."""
    max_block_m = _MAX_BLOCK_M if row_bytes <= 512 else 16
    block_q = max(1, min(triton.next_power_of_2(max(1, max_query_len)), max_block_m // group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    tile_n = 64 if block_m >= 64 and row_bytes <= 256 else 32
    return block_q, block_m, tile_n


def _num_splits(num_programs: int) -> int:
    """Key-range splits per query tile: a power of two that brings a small batch's programs up to
    about _TARGET_PROGRAMS (decoding one long sequence would otherwise busy KVH programs only)."""
    splits = 1
    while splits < _MAX_SPLITS and 2 * splits * num_programs <= _TARGET_PROGRAMS:
        splits *= 2
    return splits


def _attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int | None,
    max_query_len: int,
    num_splits: int,
    softcap: float | None = None,
) -> None:
    """unified_attention with the split count chosen: with num_splits > 1 each split attends a
    share of the key tiles into float32 partials, merged by a second kernel."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    head_dim_pad = _head_dim_pad(head_dim)
    block_q, block_m, tile_n = _tile_sizes(group, max_query_len, head_dim_pad * q.element_size())
    if num_splits > 1:
        # Rows no program writes (padding sequences) keep l = 0, which the merge skips.
        part_m = q.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
        part_l = q.new_zeros((num_tokens, num_heads, num_splits), dtype=torch.float32)
        part_acc = q.new_empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused
    interpret = q.device.type == "cpu"
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)  # shapes and host ints only
    launcher(_attention_kernel, q.device)[grid](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, query_start_loc, seq_lens, block_tables,
        scale * _LOG2_E,  # the kernel exponentiates with exp2
        num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        WINDOW=window or 0,
        SOFTCAP=0.0 if softcap is None else softcap * _LOG2_E,  # in the kernel's log2 units; 0: none
        NUM_SPLITS=num_splits,
        INTERPRET=interpret,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 models: fp32 scores
        num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        launcher(_merge_kernel, q.device)[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits, num_warps=4,
        )  # fmt: skip


def _head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _check_unit_stride(*tensors: torch.Tensor) -> None:
    """Kernels step through the last dimension (head dim; index lists) one element at a time."""
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("triton attention needs unit stride in the last dimension of each tensor")


# Integer arguments that change from step to step. Triton specializes a kernel on each integer
# argument's value class (1, a multiple of 16, other) unless told not to, and compiles a variant per
# class combination on its first launch: per-step values would compile new variants while serving.
_PER_STEP_INTS: dict[str, tuple[str, ...]] = {"_attention_kernel": ("num_seqs", "stride_table")}
_JIT: list[JITFunction[Any]] = []  # every compiled-mode kernel made so far (compiled_variants)


@cache
def _compiled(fn: Callable[..., None], interpret: bool) -> Any:
    if interpret:
        return InterpretedFunction(fn)
    jit = JITFunction(fn, do_not_specialize=_PER_STEP_INTS.get(fn.__name__, ()))
    _JIT.append(jit)
    return jit


def compiled_variants() -> int:
    """How many kernel variants Triton has compiled (or loaded from its cache) in this process
    for the engine's kernels: a count that grows while serving is a step stalled on a compile."""
    total = 0
    for jit in _JIT:
        for caches in getattr(jit, "device_caches", {}).values():
            # (kernel cache, ...) per device since Triton 3.0; a layout it does not know counts 0
            if isinstance(caches, tuple) and caches and isinstance(caches[0], dict):
                total += len(caches[0])
    return total


def launcher(fn: Callable[..., None], device: torch.device) -> Any:
    """The launchable kernel for `device`: interpreted on CPU tensors, compiled on GPU tensors."""
    return _compiled(fn, device.type == "cpu")
