"""Attention over the paged KV cache, and the per-step context every layer shares.

Three backends (EngineArgs.attention_backend). triton: every sequence of the step (prompt chunks,
prefix-cache hits, decodes, draft verification) in one launch of the Triton kernel
(model/triton_attention.py), which reads K/V through the block tables; the default on CUDA, and
the one CUDA graphs capture. native and sdpa, below, are the CPU paths and the reference.

Decodes (one new token per sequence): the native paged kernel (model/native.py) reads K/V through
the block tables for all of them at once; without it, one padded SDPA call per group of similar
lengths over gathered blocks. Prompt chunks: per sequence over its gathered blocks, either one SDPA
call or, for bf16 on CPUs that multiply bf16 natively, `matmul_prompt_attention` (blocks of query
rows as two batched matmuls each: 2.3-2.9x PyTorch's CPU flash kernel there, AVX512-BF16).
When a sequence's queries are fewer than
its keys (chunked prefill, prefix-cache hits) the causal mask is aligned bottom-right: query i sits
at absolute position ctx_len - num_queries + i. SDPA's `is_causal=True` aligns top-left, which is
only right when queries and keys coincide, so it is used only for fresh prefills.

An fp8 cache (--kv-cache-dtype, model/kv_dtype.py): new rows are cast in as they are written, and
every path converts what it gathers back to the model's dtype; fresh prompts attend their rows as
the cache holds them, so a later prefix-cache hit reads the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from corral_engine.errors import ModelLoadError
from corral_engine.model.kv_dtype import write_fp8
from corral_engine.model.native import PagedDecode

# In place on a prompt block's [KVH, rows * G, cols] scores: (scores, rows, first, window); native.FusedOps.
CausalSoftmax = Callable[[torch.Tensor, int, int, "int | None", float], None]
# (k, v, k_cache, v_cache, slot_mapping): the step's new K/V rows into their cache slots.
KVWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(slots=True)
class SeqAttention:
    q_start: int  # row range of this sequence in the step's flattened token batch
    q_end: int
    ctx_len: int  # tokens of context after this step (cached + new)
    block_ids: torch.Tensor  # [num_blocks] long: the blocks covering ctx_len
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # by sliding window (0 = none)

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    @property
    def is_fresh(self) -> bool:
        """Nothing cached before this step: keys are exactly this step's new tokens."""
        return self.num_queries == self.ctx_len

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Boolean [num_queries, ctx_len] (True = attend) or None when SDPA needs no mask."""
        key = window or 0
        if key not in self.masks:
            self.masks[key] = _bottom_right_mask(self.num_queries, self.ctx_len, window)
        return self.masks[key]


def _bottom_right_mask(num_queries: int, ctx_len: int, window: int | None) -> torch.Tensor | None:
    if num_queries == 1 and (window is None or ctx_len <= window):
        return None  # one query at the end sees every key
    q_pos = torch.arange(ctx_len - num_queries, ctx_len).unsqueeze(1)  # [nq, 1]
    k_pos = torch.arange(ctx_len).unsqueeze(0)  # [1, L]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    return allowed


@dataclass(slots=True)
class DecodeBatch:
    """Every sequence with exactly one new token, attended in one batched call: their blocks are
    gathered into a padded [S, max_blocks * block_size] key range and padding is masked out."""

    rows: torch.Tensor  # [S] long: rows of these sequences in the step's token batch
    block_tables: torch.Tensor  # [S, max_blocks] long; past a context's blocks: stale ids, masked
    ctx_lens: torch.Tensor  # [S] long
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by sliding window (0 = none)

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """Boolean [S, 1, 1, L]: key position < ctx_len (and inside the window)."""
        key = window or 0
        if key not in self.masks:
            num_keys = self.block_tables.shape[1] * block_size
            k_pos = torch.arange(num_keys, device=self.ctx_lens.device).unsqueeze(0)  # [1, L]
            lens = self.ctx_lens.unsqueeze(1)  # [S, 1]
            allowed = k_pos < lens
            if window is not None:
                allowed &= k_pos > lens - 1 - window
            self.masks[key] = allowed[:, None, None, :]
        return self.masks[key]


@dataclass(frozen=True, slots=True)
class UnifiedBatch:
    """Every sequence of a step for the Triton kernel. Captured CUDA graphs hold these as views of
    persistent buffers, with padding sequences (seq_len 0) that the kernel skips."""

    query_start_loc: torch.Tensor  # [S + 1] int32: sequence i's rows are [loc[i], loc[i + 1])
    seq_lens: torch.Tensor  # [S] int32: context after this step (cached + new); 0: padding
    block_tables: torch.Tensor  # [S, max_blocks] int32; past a context's blocks: stale, never read
    max_query_len: int  # host-side bound of any sequence's rows (1: decodes only)


@dataclass(slots=True)
class AttentionContext:
    """Built once per step by the model runner; read by every layer."""

    slot_mapping: torch.Tensor  # [T]: cache slot (block * block_size + offset) of each new token
    seqs: list[SeqAttention]  # sequences attended one by one (prompt chunks)
    block_size: int
    decodes: list[DecodeBatch] = field(default_factory=list)  # batched decodes, grouped by length
    decode_kernel: PagedDecode | None = None  # native paged decode (all decodes in one batch; fp8 KV too)
    unified: UnifiedBatch | None = None  # the triton backend: everything in one launch
    # Prompt chunks through matmul_prompt_attention in blocks of this many query rows; 0: SDPA.
    prompt_block_rows: int = 0
    prompt_softmax: CausalSoftmax | None = None  # ... with the native masked softmax (bf16)
    kv_write: KVWrite | None = None  # the native KV cache write (bf16 on the CPU); else index_copy_


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    ctx: AttentionContext,
    scale: float,
    window: int | None,
    softcap: float | None = None,  # Gemma 2: scores -> softcap * tanh(scores / softcap)
) -> torch.Tensor:  # [T, H, D]
    if ctx.unified is not None:
        from corral_engine.model import triton_attention  # imports triton: only for this backend

        triton_attention.write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        out = torch.empty_like(q)
        u = ctx.unified
        triton_attention.unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            u.query_start_loc,
            u.seq_lens,
            u.block_tables,
            scale,
            window,
            u.max_query_len,
            softcap,
        )
        return out
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_cache.dtype != k.dtype:  # fp8: from here on k and v are the rows as stored
        k, v = write_fp8(k, v, k_cache, v_cache, ctx.slot_mapping)
    elif ctx.kv_write is not None:
        ctx.kv_write(k, v, k_cache, v_cache, ctx.slot_mapping)
    else:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, ctx.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, ctx.slot_mapping, v)
    out = torch.empty_like(q)
    # SDPA and the native kernels cannot soft-cap scores: a capped model's prompts go through the
    # blocked matmuls (with PyTorch's softmax), its decodes through padded matmuls, and the native
    # backend is refused at start-up (choose_attention_backend).
    block_rows = ctx.prompt_block_rows or (PROMPT_BLOCK_ROWS if softcap is not None else 0)
    prompt_softmax = ctx.prompt_softmax if softcap is None else None
    for batch in ctx.decodes:
        if ctx.decode_kernel is not None:
            qs = q.index_select(0, batch.rows)  # [S, H, D]
            o = ctx.decode_kernel(qs, k_cache, v_cache, batch.block_tables, batch.ctx_lens, scale, window)
            out.index_copy_(0, batch.rows, o)
        else:
            _decode_attention(q, k_cache, v_cache, batch, ctx.block_size, scale, window, out, softcap)
    for s in ctx.seqs:
        qs = q[s.q_start : s.q_end].transpose(0, 1)  # [H, nq, D]
        if s.is_fresh:
            ks = k[s.q_start : s.q_end]  # [L, KVH, D]
            vs = v[s.q_start : s.q_end]
        else:
            rows = (-1, num_kv_heads, head_dim)  # [L, KVH, D], in the model's dtype
            ks = k_cache.index_select(0, s.block_ids).view(rows)[: s.ctx_len].to(q.dtype)
            vs = v_cache.index_select(0, s.block_ids).view(rows)[: s.ctx_len].to(q.dtype)
        if block_rows:
            matmul_prompt_attention(
                q[s.q_start : s.q_end], ks, vs, scale, window, block_rows, prompt_softmax,
                out=out[s.q_start : s.q_end], softcap=softcap,
            )  # fmt: skip
            continue
        mask = s.mask(window)
        use_causal = s.is_fresh and mask is not None and window is None
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1),  # [KVH, L, D]
            vs.transpose(0, 1),
            attn_mask=None if use_causal else mask,
            is_causal=use_causal,
            scale=scale,
            enable_gqa=True,
        )  # [H, nq, D]
        out[s.q_start : s.q_end] = o.transpose(0, 1)
    return out


# Query rows per block of matmul_prompt_attention: on a 2 vCPU AMD EPYC with AVX512-BF16, 64 and
# 128 were within noise of each other with PyTorch's masked softmax (docs/engine-speed.md); 64 keeps
# a block's scores small. With the native masked softmax the mask costs nothing, and fewer, larger
# blocks win: 128 rows, 1.1x 64 for 250-1,000-token prompts.
PROMPT_BLOCK_ROWS = 64
NATIVE_SOFTMAX_BLOCK_ROWS = 128


def prompt_block_rows(
    dtype: torch.dtype, is_cpu: bool, has_native_bf16: bool, mode: str, native_softmax: bool = False
) -> int:
    """Query rows per block for matmul_prompt_attention, or 0 for SDPA (CORRAL_MATMUL_PROMPT_ATTENTION).

    auto: bf16 on a CPU that multiplies bf16 natively (AVX512-BF16, AMX), where oneDNN's batched
    bf16 matmuls beat PyTorch's CPU flash-attention kernel 2.3-2.9x for 128-2,048-token prompts
    (prompt throughput 1.1-1.8x; measured with AVX512-BF16; with AMX the two were level for a
    2,000-token prompt, docs/engine-speed.md, 2026-12-01). Without native bf16
    a bf16 matmul is emulated and slow, and in float32 the two are level, so SDPA stays there.
    "1": on any CPU; "0": never. `native_softmax`: the blocks' softmax is the native kernel's
    (bf16 only), which takes larger blocks."""
    if not is_cpu or mode == "0":
        return 0
    rows = NATIVE_SOFTMAX_BLOCK_ROWS if native_softmax and dtype == torch.bfloat16 else PROMPT_BLOCK_ROWS
    if mode == "1":
        return rows
    return rows if dtype == torch.bfloat16 and has_native_bf16 else 0


def choose_attention_backend(
    requested: str, device_type: str, has_native: bool, triton_interpret: bool, has_softcap: bool = False
) -> str:
    """The attention backend for `requested` (EngineArgs.attention_backend) on this device:
    auto is triton on CUDA, else native where its kernel built (and takes this dtype), else sdpa.
    A backend that cannot run here is an error that says why. `has_softcap`: the model soft-caps
    attention scores (Gemma 2), which the native kernels cannot: auto takes sdpa on the CPU."""
    if requested == "auto":
        return "triton" if device_type == "cuda" else "native" if has_native and not has_softcap else "sdpa"
    if requested == "native" and has_softcap:
        raise ModelLoadError(
            "attention backend native cannot soft-cap attention scores (attn_logit_softcapping, "
            "Gemma 2); use auto, sdpa or triton"
        )
    if requested == "triton" and device_type != "cuda" and not triton_interpret:
        raise ModelLoadError(
            "attention backend triton runs on CUDA, or on the CPU under Triton's interpreter "
            "(TRITON_INTERPRET=1; slow, for tests)"
        )
    if requested == "native" and not has_native:
        why = (
            "it is a CPU kernel"
            if device_type != "cpu"
            else "its kernel did not build here or takes no such dtype"
        )
        raise ModelLoadError(f"attention backend native is unavailable: {why}; use auto or sdpa")
    return requested


def matmul_prompt_attention(
    q: torch.Tensor,  # [nq, H, D]: one sequence's new rows
    k: torch.Tensor,  # [L, KVH, D]: its whole context, the new rows last
    v: torch.Tensor,  # [L, KVH, D]
    scale: float,
    window: int | None,
    block_rows: int,
    softmax: CausalSoftmax | None = None,
    out: torch.Tensor | None = None,  # [nq, H, D], contiguous: written in place of a new tensor
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); not with `softmax`
) -> torch.Tensor:  # [nq, H, D]
    """Causal attention for one sequence, bottom-right aligned (query i at position L - nq + i), as
    a loop over blocks of `block_rows` query rows: scores = Q_block K^T over the keys the block
    can see (one batched matmul, a matrix per KV head with its query heads as extra rows: no K/V
    repeat), the causal/window mask on the columns it hides, softmax, then P V.

    Numerics of transformers' eager attention: scores and probabilities are rounded to the input
    dtype (the softmax itself runs in float32 inside PyTorch's kernel). q is scaled before the
    matmul, exactly where the scale is a power of two (head_dim 64, 256). `softmax` (the native
    fused op, bf16 only) does the scale, the mask and the softmax in one pass per row, by bounds,
    so q is only laid out, not scaled: eager's `(q @ k^T) * scaling` rounding for any scale."""
    nq, num_heads, head_dim = q.shape
    ctx_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    offset = ctx_len - nq
    # [KVH, nq, G, D]: a block of rows is one contiguous [rows * G, D] matrix per KV head.
    if softmax is None:
        q = q * scale
    qh = q.view(nq, num_kv_heads, group, head_dim).transpose(0, 1).contiguous()
    kh = k.transpose(0, 1).contiguous()  # [KVH, L, D]
    vh = v.transpose(0, 1).contiguous()
    result = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    out = result.view(nq, num_kv_heads, group, head_dim)  # the blocks' rows land here
    for a in range(0, nq, block_rows):
        b = min(a + block_rows, nq)
        rows = b - a
        hi = offset + b  # keys [lo, hi): everything this block's last row sees
        lo = 0 if window is None else max(0, offset + a - window + 1)
        qb = qh[:, a:b].reshape(num_kv_heads, rows * group, head_dim)
        scores = torch.bmm(qb, kh[:, lo:hi].transpose(1, 2))  # [KVH, rows * G, hi - lo]
        first = offset + a + 1 - lo  # the first key column the block's first row must not see
        if softmax is not None:
            softmax(scores, rows, first, window, scale)
            out[a:b] = (
                torch.bmm(scores, vh[:, lo:hi]).view(num_kv_heads, rows, group, head_dim).transpose(0, 1)
            )
            continue
        if softcap is not None:  # Gemma 2, before the mask (transformers' eager order)
            scores.div_(softcap).tanh_().mul_(softcap)
        by_row = scores.view(num_kv_heads, rows, group, hi - lo)
        q_pos = torch.arange(offset + a, offset + b, device=q.device).view(rows, 1, 1)
        if window is None:
            if first < hi - lo:
                k_pos = torch.arange(lo + first, hi, device=q.device)
                by_row[..., first:].masked_fill_(k_pos > q_pos, float("-inf"))
        else:
            k_pos = torch.arange(lo, hi, device=q.device)
            by_row.masked_fill_((k_pos > q_pos) | (q_pos - k_pos >= window), float("-inf"))
        o = torch.bmm(scores.softmax(-1), vh[:, lo:hi])  # [KVH, rows * G, D]
        out[a:b] = o.view(num_kv_heads, rows, group, head_dim).transpose(0, 1)
    return result


def _decode_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    block_size: int,
    scale: float,
    window: int | None,
    out: torch.Tensor,  # [T, H, D], written at batch.rows
    softcap: float | None = None,
) -> None:
    num_seqs, max_blocks = batch.block_tables.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    flat_tables = batch.block_tables.view(-1)
    # [S, L, KVH, D] -> [S, KVH, L, D]; an fp8 cache's rows converted after the gather (fewer bytes)
    shape = (num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    ks = k_cache.index_select(0, flat_tables).view(shape).to(q.dtype)
    vs = v_cache.index_select(0, flat_tables).view(shape).to(q.dtype)
    # The query heads sharing a KV head become that head's "query positions": no K/V repeat.
    qs = q.index_select(0, batch.rows).view(num_seqs, num_kv_heads, group, head_dim)  # [S, KVH, G, D]
    mask = batch.mask(window, block_size)  # [S, 1, 1, L]
    if softcap is None:
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(1, 2), vs.transpose(1, 2), attn_mask=mask, scale=scale
        )
    else:  # SDPA cannot cap the scores: the same attention as matmuls
        scores = torch.matmul(qs, ks.permute(0, 2, 3, 1)).mul_(scale)  # [S, KVH, G, L]
        scores.div_(softcap).tanh_().mul_(softcap).masked_fill_(~mask, float("-inf"))
        o = torch.matmul(scores.softmax(-1), vs.transpose(1, 2))  # [S, KVH, G, D]
    out.index_copy_(0, batch.rows, o.reshape(num_seqs, num_kv_heads * group, head_dim))
