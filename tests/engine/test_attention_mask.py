"""The causal mask must be aligned bottom-right when queries are fewer than keys."""

from __future__ import annotations

import math

import torch
from corral_engine.model.attention import AttentionContext, SeqAttention, paged_attention


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
