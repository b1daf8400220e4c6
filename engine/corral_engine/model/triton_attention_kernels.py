"""The Triton kernels behind model/triton_attention.py (which says how they tile, launch and run on
CPU): the KV cache write, the unified paged attention, and the merge of split-key partials. Plain
functions, compiled per device by `triton_attention.launcher`."""

from __future__ import annotations

import triton.language as tl


def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, INTERPRET: tl.constexpr,
    KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """One program per new token: copies its [KVH, D] K and V rows into its cache slot (FP8_MAX > 0:
    clamped to +-FP8_MAX in float32 and cast to the fp8 cache's dtype)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row of a captured batch
        return
    offs_h = tl.arange(0, KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * (KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX)
        if INTERPRET:
            k = _round_to_fp8_grid(k, FP8_MANTISSA, FP8_MIN_EXP)
            v = _round_to_fp8_grid(v, FP8_MANTISSA, FP8_MIN_EXP)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _round_to_fp8_grid(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):  # fmt: skip
    """float32 `x` rounded to nearest-even on the fp8 format's grid, for the interpreter only: its
    cast into fp8 rounds half up and drops the carry into the exponent (Triton 3.9: 124.8 -> 64), but
    casts a value already on the grid exactly. Adding C = 1.5 * 2^(s + 23), whose float32 ulp is
    the grid's spacing 2^s at x's exponent, rounds x there; subtracting C leaves the rounded x."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |x|); 0: -127
    spacing = tl.maximum(exponent, MIN_EXP) - MANTISSA
    magic = (((spacing + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (x + magic) - magic


def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2,
    num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out rows of one (query tile, KV head): softmax(q K^T * scale) V over the sequence's keys;
    with NUM_SPLITS > 1, float32 partials (running max, sum, unnormalised acc) over a key share.
    SOFTCAP > 0 (the cap times log2(e)): scores soft-capped, s -> SOFTCAP * tanh(s / SOFTCAP)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The last sequence whose first tile number qsl[i] // BLOCK_Q + i is <= tile (those numbers
    # grow strictly with i). Fixed trip count: log2(S) halvings, branch-free.
    lo = tl.program_id(0) * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        is_left = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(is_left, mid, lo)
        hi = tl.where(is_left, hi, mid)
    seq = lo
    q_begin = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query = (tile - q_begin // BLOCK_Q - seq) * BLOCK_Q  # of this tile, within the sequence
    if first_query >= num_queries:  # a spare program
        return
    if seq_len == 0:  # a padding sequence
        return

    # Row m: query first_query + m // GROUP, head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    query = first_query + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    is_row = (offs_m < BLOCK_Q * GROUP) & (query < num_queries)
    q_pos = seq_len - num_queries + query  # absolute position, bottom-right aligned
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    is_dim = offs_d < HEAD_DIM
    token = (q_begin + query).to(tl.int64)
    row_mask = is_row[:, None] & is_dim[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if INTERPRET:
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last query's position, from its first query's window on.
    first_pos = seq_len - num_queries + first_query
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    kv_begin = first_pos * 0
    if WINDOW > 0:
        kv_begin = tl.maximum(first_pos - WINDOW + 1, 0) // TILE_N * TILE_N
    if NUM_SPLITS > 1:  # this split's share of whole key tiles
        split_len = (kv_end - kv_begin + TILE_N * NUM_SPLITS - 1) // (TILE_N * NUM_SPLITS) * TILE_N
        kv_begin = kv_begin + split * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of scaled scores (log2)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    cache_head = kv_head.to(tl.int64) * stride_cache_head
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_begin, kv_end, TILE_N):
        k_pos = start + offs_n
        is_key = k_pos < kv_end  # never reads a block-table entry past the context
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
        slot = block * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_slot + cache_head
        k_t = tl.load(
            k_cache_ptr + slot[None, :] + offs_d[:, None],
            mask=is_dim[:, None] & is_key[None, :],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        v = tl.load(
            v_cache_ptr + slot[:, None] + offs_d[None, :],
            mask=is_key[:, None] & is_dim[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if INTERPRET:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        else:  # an fp8 cache's tiles to the queries' dtype (a no-op for a cache in the model's)
            k_t = k_t.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if SOFTCAP > 0:  # a constexpr: uncapped models compile without it
            # tanh(s / cap) = 1 - 2 / (e^(2 s / cap) + 1) from exp2, inline (the interpreter has no
            # libdevice tanh, and a compiled kernel calls only jit functions); +-1 past overflow.
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp2(s * (2.8853900817779268 / SOFTCAP)) + 1.0))
        allowed = is_row[:, None] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        if INTERPRET:  # tl.max / tl.sum are jit functions, which the interpreter cannot call
            row_max = tl.reduce(s, 1, tl.standard._elementwise_max)
        else:
            row_max = tl.max(s, axis=1)
        m_new = tl.maximum(m_i, row_max)
        # A row with nothing visible yet keeps m = -inf; subtract 0 there instead (no inf - inf).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        if INTERPRET:
            row_sum = tl.reduce(p, 1, tl.standard._sum_combine)
        else:
            row_sum = tl.sum(p, axis=1)
        l_i = l_i * alpha + row_sum
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:  # partials [T, H, NUM_SPLITS(, HEAD_DIM_PAD)]; an empty share writes m = -inf, l = 0
        part = (token * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=is_row)
        tl.store(part_l_ptr + part, l_i, mask=is_row)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=is_row[:, None])


def _merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """One program per (token, head): rescales the splits' partials to a common max and sums them.
    Rows whose partials all have l = 0 belong to no sequence (padding) and stay untouched."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS
    l_total = tl.load(part_l_ptr + part)
    for j in tl.static_range(1, NUM_SPLITS):
        l_total += tl.load(part_l_ptr + part + j)
    if l_total == 0.0:  # no sequence's row: the other partials are unwritten garbage
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_run = tl.load(part_m_ptr + part)
    l_run = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part * HEAD_DIM_PAD + offs_d)
    for j in tl.static_range(1, NUM_SPLITS):
        m_j = tl.load(part_m_ptr + part + j)
        m_new = tl.maximum(m_run, m_j)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_shift)
        beta = tl.exp2(m_j - m_shift)
        l_run = l_run * alpha + tl.load(part_l_ptr + part + j) * beta
        acc = acc * alpha + tl.load(part_acc_ptr + (part + j) * HEAD_DIM_PAD + offs_d) * beta
        m_run = m_new
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        (acc / l_run).to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
