"""The causal mask must be aligned bottom-right when queries are fewer than keys."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from corral_engine.model.attention import (
    NATIVE_SOFTMAX_BLOCK_ROWS,
    PROMPT_BLOCK_ROWS,
    AttentionContext,
    SeqAttention,
    matmul_prompt_attention,
    paged_attention,
    prompt_block_rows,
)
from corral_engine.model.native import load_fused_ops
from corral_engine.settings import EngineSettings


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    # q: [nq, H, D], k/v: [L, H, D]; query i sits at absolute position q_offset + i.
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    nq, num_keys = q.shape[0], k.shape[0]
    allowed = torch.arange(num_keys)[None, :] <= (q_offset + torch.arange(nq))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_chunk_after_cached_prefix_matches_naive_attention() -> None:
    torch.manual_seed(0)
    heads, dim, bs, num_blocks = 2, 8, 4, 8
    ctx_len, nq = 11, 5  # 6 tokens cached, 5 new: queries sit at positions 6..10
    k_all, v_all = torch.randn(ctx_len, heads, dim), torch.randn(ctx_len, heads, dim)
    q = torch.randn(nq, heads, dim)
    k_cache = torch.zeros(num_blocks, bs, heads, dim)
    v_cache = torch.zeros(num_blocks, bs, heads, dim)
    table = [5, 2, 7]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx_len)])
    k_cache.view(-1, heads, dim)[slots[: ctx_len - nq]] = k_all[: ctx_len - nq]
    v_cache.view(-1, heads, dim)[slots[: ctx_len - nq]] = v_all[: ctx_len - nq]
    ctx = AttentionContext(slots[ctx_len - nq :], [SeqAttention(0, nq, ctx_len, torch.tensor(table))], bs)
    out = paged_attention(
        q, k_all[ctx_len - nq :], v_all[ctx_len - nq :], k_cache, v_cache, ctx, dim**-0.5, None
    )
    want = naive(q, k_all, v_all, ctx_len - nq)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # SDPA's is_causal=True aligns top-left: different (wrong) numbers for this shape.
    wrong = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    assert not torch.allclose(wrong, want, atol=1e-3)


def test_decodes_are_grouped_so_padding_stays_bounded() -> None:
    from corral_engine.model.batch import group_by_length

    lengths = [1, 40, 2, 41, 3, 60, 1, 100]
    groups = group_by_length(lengths, max_waste=0.5)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        widths = [lengths[i] for i in group]
        assert max(widths) <= 1.5 * max(1, min(widths))
    assert len(group_by_length([5] * 100, max_group=64)) == 2


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, softcap: float | None = None
) -> torch.Tensor:
    """Float64, K/V repeated per query head, bottom-right causal (and sliding-window) mask; scores
    soft-capped with `softcap` (Gemma 2)."""
    nq, num_heads, _ = q.shape
    num_keys, group = k.shape[0], num_heads // k.shape[1]
    q_pos = (num_keys - nq + torch.arange(nq))[:, None]
    k_pos = torch.arange(num_keys)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    kd, vd = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vd)


@pytest.mark.parametrize(
    ("num_queries", "num_keys", "window", "block_rows"),
    [
        (37, 37, None, 8),  # a fresh prompt, the last block partial
        (37, 37, None, 64),  # one block
        (5, 29, None, 4),  # a chunk after 24 cached tokens
        (40, 40, 9, 8),  # sliding window: early keys drop out of later blocks
        (12, 50, 16, 5),  # window and cached prefix
        (1, 20, None, 8),  # a single row (a prompt's last token)
    ],
)
def test_matmul_prompt_attention_matches_the_reference(
    num_queries: int, num_keys: int, window: int | None, block_rows: int
) -> None:
    torch.manual_seed(num_queries * 100 + num_keys)
    heads, kv_heads, dim = 6, 2, 16  # grouped-query: three query heads per KV head
    q = torch.randn(num_queries, heads, dim)
    k, v = torch.randn(num_keys, kv_heads, dim), torch.randn(num_keys, kv_heads, dim)
    want = reference(q, k, v, window)
    out = matmul_prompt_attention(q, k, v, dim**-0.5, window, block_rows)
    assert out.shape == (num_queries, heads, dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # bf16: scores and probabilities rounded to bf16, as transformers' eager attention does.
    low = matmul_prompt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), dim**-0.5, window, block_rows)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), want, atol=0.05, rtol=0.05)
    # The native masked softmax (bf16): the same numbers to within a bf16 rounding or two.
    ops = load_fused_ops(EngineSettings(native_kernels=True)) if shutil.which("cc") else None
    if ops is not None:
        fused = matmul_prompt_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), dim**-0.5, window, block_rows, ops.causal_softmax
        )
        torch.testing.assert_close(fused.double(), want, atol=0.05, rtol=0.05)
        torch.testing.assert_close(fused.double(), low.double(), atol=0.02, rtol=0.02)


def test_paged_attention_takes_the_matmul_path_when_asked() -> None:
    torch.manual_seed(1)
    heads, dim, bs = 4, 8, 4
    ctx_len, nq = 14, 6
    k_all, v_all, q = (
        torch.randn(ctx_len, heads, dim),
        torch.randn(ctx_len, heads, dim),
        torch.randn(nq, heads, dim),
    )
    k_cache, v_cache = torch.zeros(6, bs, heads, dim), torch.zeros(6, bs, heads, dim)
    table = [3, 0, 5, 1]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx_len)])
    k_cache.view(-1, heads, dim)[slots] = k_all
    v_cache.view(-1, heads, dim)[slots] = v_all
    seq = SeqAttention(0, nq, ctx_len, torch.tensor(table))
    ctx = AttentionContext(slots[ctx_len - nq :], [seq], bs, prompt_block_rows=4)
    out = paged_attention(q, k_all[-nq:], v_all[-nq:], k_cache, v_cache, ctx, dim**-0.5, None)
    torch.testing.assert_close(out, naive(q, k_all, v_all, ctx_len - nq), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernels")
def test_paged_attention_hands_prompt_blocks_to_the_contexts_softmax() -> None:
    ops = load_fused_ops(EngineSettings(native_kernels=True))
    assert ops is not None
    torch.manual_seed(2)
    heads, dim, bs, ctx_len, nq = 4, 8, 4, 14, 6
    k_all, v_all = torch.randn(ctx_len, 2, dim).bfloat16(), torch.randn(ctx_len, 2, dim).bfloat16()
    q = torch.randn(nq, heads, dim).bfloat16()
    k_cache, v_cache = torch.zeros(6, bs, 2, dim).bfloat16(), torch.zeros(6, bs, 2, dim).bfloat16()
    table = [3, 0, 5, 1]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx_len)])
    k_cache.view(-1, 2, dim)[slots] = k_all
    v_cache.view(-1, 2, dim)[slots] = v_all
    calls: list[tuple[int, int]] = []

    def spy(scores: torch.Tensor, rows: int, first: int, window: int | None, scale: float) -> None:
        calls.append((rows, first))
        ops.causal_softmax(scores, rows, first, window, scale)

    seq = SeqAttention(0, nq, ctx_len, torch.tensor(table))
    ctx = AttentionContext(slots[ctx_len - nq :], [seq], bs, prompt_block_rows=4, prompt_softmax=spy)
    out = paged_attention(q, k_all[-nq:], v_all[-nq:], k_cache, v_cache, ctx, dim**-0.5, None)
    assert calls == [(4, 9), (2, 13)]  # two blocks; the first row of each sees keys [0, first)
    want = reference(q.double(), k_all.double(), v_all.double(), None)
    torch.testing.assert_close(out.double(), want, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("window", [None, 5])
def test_soft_capped_scores_take_neither_sdpa_nor_the_native_softmax(window: int | None) -> None:
    """Gemma 2's attn_logit_softcapping: a prompt chunk after cached blocks (no block rows asked:
    SDPA otherwise) and two padded decodes, each equal to the capped reference; the context's
    native softmax, which cannot cap, is never called."""
    from corral_engine.model.attention import DecodeBatch

    torch.manual_seed(3)
    heads, kv_heads, dim, bs, softcap = 4, 2, 8, 4, 0.5
    lens = [14, 9, 6]  # a 6-query chunk after 8 cached tokens, then two decodes
    k_all = [torch.randn(n, kv_heads, dim) * 2 for n in lens]
    v_all = [torch.randn(n, kv_heads, dim) for n in lens]
    tables = [[3, 0, 5, 1], [2, 4, 6], [7, 8]]
    k_cache, v_cache = torch.zeros(9, bs, kv_heads, dim), torch.zeros(9, bs, kv_heads, dim)
    slots = [
        torch.tensor([t[p // bs] * bs + p % bs for p in range(n)]) for t, n in zip(tables, lens, strict=True)
    ]
    for s, k, v in zip(slots, k_all, v_all, strict=True):
        k_cache.view(-1, kv_heads, dim)[s], v_cache.view(-1, kv_heads, dim)[s] = k, v
    q = torch.randn(8, heads, dim) * 2  # rows 0-5: the chunk; 6, 7: the decodes

    def never(*_: object) -> None:
        raise AssertionError("the native softmax cannot soft-cap")

    decodes = DecodeBatch(
        torch.tensor([6, 7]), torch.tensor([tables[1], tables[2] + [0]]), torch.tensor(lens[1:])
    )
    ctx = AttentionContext(
        torch.cat([slots[0][-6:], slots[1][-1:], slots[2][-1:]]),
        [SeqAttention(0, 6, lens[0], torch.tensor(tables[0]))],
        bs,
        decodes=[decodes],
        prompt_softmax=never,
    )
    new_k = torch.cat([k_all[0][-6:], k_all[1][-1:], k_all[2][-1:]])
    new_v = torch.cat([v_all[0][-6:], v_all[1][-1:], v_all[2][-1:]])
    out = paged_attention(q, new_k, new_v, k_cache, v_cache, ctx, dim**-0.5, window, softcap)
    want = [
        reference(q[:6], k_all[0], v_all[0], window, softcap),
        reference(q[6:7], k_all[1], v_all[1], window, softcap),
        reference(q[7:], k_all[2], v_all[2], window, softcap),
    ]
    torch.testing.assert_close(out.double(), torch.cat(want), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[:6].double(), reference(q[:6], k_all[0], v_all[0], window), atol=1e-2)


def test_prompt_block_rows_is_on_for_bf16_where_the_cpu_multiplies_it_natively() -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    assert prompt_block_rows(bf16, True, True, "auto") == PROMPT_BLOCK_ROWS
    assert prompt_block_rows(bf16, True, False, "auto") == 0  # emulated bf16 matmuls: SDPA
    assert prompt_block_rows(f32, True, True, "auto") == 0  # level in float32: SDPA
    assert prompt_block_rows(f32, True, False, "1") == PROMPT_BLOCK_ROWS
    assert prompt_block_rows(bf16, True, True, "0") == 0
    assert prompt_block_rows(bf16, False, True, "1") == 0  # not a CPU (the triton backend)
    # The native masked softmax takes larger blocks (bf16 only: it is a bf16 kernel).
    assert prompt_block_rows(bf16, True, True, "auto", native_softmax=True) == NATIVE_SOFTMAX_BLOCK_ROWS
    assert prompt_block_rows(f32, True, True, "1", native_softmax=True) == PROMPT_BLOCK_ROWS
    assert prompt_block_rows(bf16, True, False, "auto", native_softmax=True) == 0
