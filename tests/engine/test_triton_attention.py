"""The Triton paged-attention kernels, run on CPU through Triton's interpreter, against a float64
reference that gathers each sequence's context through its block table."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")  # a dependency on Linux x86-64 only
from corral_engine.model import triton_attention
from corral_engine.model.kv_dtype import to_cache
from corral_engine.model.triton_attention import unified_attention, write_kv

# float32: the kernels accumulate in float32 against a float64 reference (errors seen ~1e-6).
# bfloat16 keeps 8 significant bits, so one ulp is at most 2^-7 of a value; the interpreter rounds
# the float32 result to bf16 toward zero (a whole ulp, where a GPU rounds to nearest: half an ulp),
# and GPUs also round the softmax weights to bf16 before the P @ V dot.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2**-7)}  # (atol, rtol)
UNTOUCHED = 123.0  # out rows of no sequence must keep this value

# A mixed batch as (context length after the step, queries this step); context 0 is padding.
MIXED = [
    (57, 57),  # fresh prefill over several blocks
    (90, 13),  # chunk after a cached prefix (prefix-cache hit): queries < keys
    (33, 1),  # decode
    (0, 2),  # padding sequence that still owns rows
    (70, 4),  # speculative verify: a decode plus three draft tokens
    (1, 1),  # first token
    (0, 0),  # padding sequence without rows
    (16, 16),  # fresh prefill of exactly one block of 16
]


# unified_attention's arguments up to the window: seven tensors, the scale, the window.
AttentionArgs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, int | None]


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D], a non-contiguous view of a fused qkv tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D], random everywhere (junk past contexts)
    v_cache: torch.Tensor
    out: torch.Tensor  # [T, H, D], filled with UNTOUCHED
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, shuffled ids, stale ids past each context
    scale: float

    def args(self, window: int | None) -> AttentionArgs:
        return (
            self.q, self.k_cache, self.v_cache, self.out, self.query_start_loc, self.seq_lens,
            self.block_tables, self.scale, window,
        )  # fmt: skip


def make_case(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    extra_rows: int = 0,  # rows past the last sequence (a padded token batch)
    num_blocks: int = 0,  # cache blocks (0: enough for the contexts, and 4 more)
    max_blocks: int = 0,  # block-table width (0: the longest context's blocks, and 2 more)
) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    max_blocks = max_blocks or max(-(-ctx // block_size) for ctx, _ in seqs) + 2
    num_blocks = num_blocks or sum(-(-ctx // block_size) for ctx, _ in seqs) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for ctx, _ in seqs:
        own = [free.pop() for _ in range(-(-ctx // block_size))]
        # Stale entries: real ids of other blocks, so reading one would change the numbers.
        tables.append(own + [rng.randrange(num_blocks) for _ in range(max_blocks - len(own))])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    starts = [0]
    for _, num_queries in seqs:
        starts.append(starts[-1] + num_queries)
    num_tokens = starts[-1] + extra_rows
    qkv = torch.randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), generator=gen).to(dtype)
    return Case(
        q=qkv[:, :num_heads],
        k_cache=k_cache,
        v_cache=v_cache,
        out=torch.full((num_tokens, num_heads, head_dim), UNTOUCHED, dtype=dtype),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def reference(case: Case, window: int | None, softcap: float | None = None) -> torch.Tensor:
    """float64 attention per sequence (scores soft-capped with `softcap`, as Gemma 2's eager
    attention does before the mask); rows of no sequence keep UNTOUCHED."""
    out = torch.full(case.out.shape, UNTOUCHED, dtype=torch.float64)
    _, block_size, num_kv_heads, head_dim = case.k_cache.shape
    group = case.q.shape[1] // num_kv_heads
    for i, ctx in enumerate(case.seq_lens.tolist()):
        begin, end = case.query_start_loc[i].item(), case.query_start_loc[i + 1].item()
        if ctx == 0 or begin == end:
            continue
        blocks = case.block_tables[i, : -(-ctx // block_size)].long()
        k = case.k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].double()  # [L, KVH, D]
        v = case.v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].double()
        heads = torch.arange(case.q.shape[1]) // group  # GQA: query head h reads KV head h // group
        scores = torch.einsum("qhd,khd->hqk", case.q[begin:end].double(), k[:, heads]) * case.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (end - begin), ctx)[:, None]  # bottom-right causal alignment
        k_pos = torch.arange(ctx)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[:, heads])
    return out


def assert_matches(case: Case, window: int | None, softcap: float | None = None) -> None:
    want = reference(case, window, softcap)
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(case.out.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "dtype", "window"),
    [
        (16, 1, 64, torch.float32, None),
        (32, 4, 128, torch.bfloat16, None),
        (16, 8, 80, torch.float32, 24),  # head dim padded to 128; window shorter than most contexts
        (32, 4, 64, torch.bfloat16, 10),
        (8, 2, 96, torch.float32, None),
        (16, 8, 128, torch.bfloat16, 40),
    ],
)
def test_mixed_batch_matches_reference(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype, window: int | None
) -> None:
    seed = block_size + group + head_dim
    case = make_case(MIXED, 2, group, head_dim, block_size, dtype, seed, extra_rows=2)
    unified_attention(*case.args(window), max_query_len=57)
    assert_matches(case, window)


def test_int64_index_tensors_work_too() -> None:
    case = make_case(MIXED, 2, 4, 64, 16, torch.float32, seed=9)
    case.query_start_loc, case.seq_lens = case.query_start_loc.long(), case.seq_lens.long()
    case.block_tables = case.block_tables.long()
    unified_attention(*case.args(None), max_query_len=57)
    assert_matches(case, None)


def test_max_query_len_is_a_tile_hint_not_a_limit() -> None:
    # Decode-sized tiles (one query each) over a batch with long chunks: more tiles, same numbers.
    case = make_case(MIXED, 2, 4, 64, 16, torch.float32, seed=3)
    unified_attention(*case.args(None), max_query_len=1)
    assert_matches(case, None)


@pytest.mark.parametrize(("num_splits", "window"), [(2, None), (4, 20)])
def test_split_keys_merge_to_the_same_result(num_splits: int, window: int | None) -> None:
    # GPUs split the keys of small batches across programs; here forced, with a 4-query chunk so
    # one sequence's tiles hold several queries, and padding rows the merge must leave alone.
    seqs = [(95, 1), (0, 1), (40, 4), (7, 1)]
    case = make_case(seqs, 2, 4, 64, 16, torch.bfloat16, seed=num_splits, extra_rows=1)
    triton_attention._attention(*case.args(window), max_query_len=4, num_splits=num_splits)
    assert_matches(case, window)


@pytest.mark.parametrize(
    ("dtype", "window", "num_splits"),
    [(torch.float32, None, 1), (torch.bfloat16, 10, 1), (torch.float32, 20, 4)],
)
def test_soft_capped_scores_match_reference(dtype: torch.dtype, window: int | None, num_splits: int) -> None:
    """Gemma 2's attn_logit_softcapping (scores -> cap * tanh(scores / cap)), at a cap the random
    scores pass (a different result without it), in one pass and with split keys."""
    softcap = 1.5
    case = make_case(MIXED, 2, 4, 64, 16, dtype, seed=21, extra_rows=2)
    case.scale = 0.5  # scores of a few units: well past the cap
    triton_attention._attention(*case.args(window), max_query_len=57, num_splits=num_splits, softcap=softcap)
    assert_matches(case, window, softcap)
    uncapped = reference(case, window)
    assert (uncapped - reference(case, window, softcap)).abs().max() > 0.1


class GridRecorder:
    """Wraps the module's launcher to record every launch grid."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.grids: list[tuple[int, ...]] = []
        launcher = triton_attention.launcher

        def recording(fn: Any, device: torch.device) -> Any:
            kernel = launcher(fn, device)
            recorder = self

            class Indexer:
                def __getitem__(self, grid: tuple[int, ...]) -> Any:
                    recorder.grids.append(grid)
                    return kernel[grid]

            return Indexer()

        monkeypatch.setattr(triton_attention, "launcher", recording)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_launch_depends_on_shapes_not_values(monkeypatch: pytest.MonkeyPatch, num_splits: int) -> None:
    # A captured CUDA graph replays the same launches on the same tensors with new values: new
    # lengths, new block tables, a sequence turned into padding.
    recorder = GridRecorder(monkeypatch)
    pool = {"num_blocks": 16, "max_blocks": 8}
    case = make_case([(40, 1), (9, 1), (75, 1)], 2, 8, 64, 16, torch.bfloat16, seed=11, **pool)
    triton_attention._attention(*case.args(None), max_query_len=1, num_splits=num_splits)
    assert_matches(case, None)
    first_grids = list(recorder.grids)

    other = make_case([(3, 1), (0, 1), (88, 1)], 2, 8, 64, 16, torch.bfloat16, seed=12, **pool)
    for name in ("q", "k_cache", "v_cache", "seq_lens", "block_tables"):
        getattr(case, name).copy_(getattr(other, name))
    case.out.fill_(UNTOUCHED)
    triton_attention._attention(*case.args(None), max_query_len=1, num_splits=num_splits)
    assert_matches(case, None)
    assert recorder.grids[len(first_grids) :] == first_grids
    assert (case.out[1] == UNTOUCHED).all()


def test_unified_attention_checks_its_inputs() -> None:
    case = make_case([(5, 5)], 2, 2, 64, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="unit stride"):
        unified_attention(case.q.transpose(1, 2).contiguous().transpose(1, 2), *case.args(None)[1:], 5)
    with pytest.raises(ValueError, match="KV heads"):
        unified_attention(case.q[:, :3], *case.args(None)[1:], 5)


def test_tile_sizes_fit_the_dot_and_the_query_rows() -> None:
    for group in (1, 2, 3, 4, 7, 8, 16, 32):
        for max_query_len in (1, 2, 5, 16, 300):
            for row_bytes in (128, 256, 512, 1024):
                block_q, block_m, tile_n = triton_attention._tile_sizes(group, max_query_len, row_bytes)
                assert block_q >= 1 and block_m >= max(16, block_q * group) and tile_n >= 16
                assert block_m & (block_m - 1) == 0 and tile_n & (tile_n - 1) == 0
    assert triton_attention._tile_sizes(8, 1, 256) == (1, 16, 32)  # a decode: the group's 8 heads
    assert triton_attention._tile_sizes(1, 512, 256) == (64, 64, 64)  # a long bf16 prefill


def test_small_batches_split_their_keys() -> None:
    assert triton_attention._num_splits(8) == 16  # one sequence, 8 KV heads: 8 programs
    assert triton_attention._num_splits(100) == 2
    assert triton_attention._num_splits(129) == 1
    assert triton_attention._num_splits(10_000) == 1


@pytest.mark.parametrize(
    ("dtype", "index_dtype"), [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)]
)
def test_write_kv_stores_rows_in_their_slots(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 3, 80, 10
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # k and v as views of a fused qkv output: strided rows, unit stride in D.
    qkv = torch.randn((num_tokens, 4 + 2 * num_kv_heads, head_dim), generator=gen).to(dtype)
    k, v = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding rows of a captured batch
    write_kv(k, v, k_cache, v_cache, slots.to(index_dtype))

    written = slots >= 0
    k_want, v_want = k_before.view(-1, num_kv_heads, head_dim), v_before.view(-1, num_kv_heads, head_dim)
    k_want[slots[written]] = k[written]
    v_want[slots[written]] = v[written]
    assert torch.equal(k_cache.view_as(k_want), k_want)
    assert torch.equal(v_cache.view_as(v_want), v_want)


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "window"),
    [
        (torch.float8_e4m3fn, torch.float32, None),
        (torch.float8_e4m3fn, torch.bfloat16, 24),
        (torch.float8_e5m2, torch.float32, 10),
        (torch.float8_e5m2, torch.bfloat16, None),
    ],
)
def test_an_fp8_cache_is_attended_as_its_rounded_values(
    cache_dtype: torch.dtype, dtype: torch.dtype, window: int | None
) -> None:
    # The reference reads the same fp8 caches in float64: attention over the fp8-rounded K/V.
    case = make_case(MIXED, 2, 4, 64, 16, dtype, seed=21, extra_rows=2)
    values = case.v_cache.float()
    # Values saturated at 448 in e4m3 (in V: keys that large would push float32 scores past the
    # tolerances, the same for any cache dtype).
    values[torch.rand(values.shape, generator=torch.Generator().manual_seed(22)) < 0.01] = -1000.0
    case.k_cache, case.v_cache = to_cache(case.k_cache, cache_dtype), to_cache(values, cache_dtype)
    unified_attention(*case.args(window), max_query_len=57)
    assert_matches(case, window)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_casts_into_an_fp8_cache_as_pytorch_does(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    # Magnitudes from 1e-12 (rounded to zero) through e4m3's subnormals and normals to 1e5 (past
    # e4m3's 448: saturated); rounding to nearest even, with carries into the exponent (124.8 -> 128).
    gen = torch.Generator().manual_seed(6)
    num_tokens, num_kv_heads, head_dim = 40, 2, 64
    magnitudes = torch.logspace(-12, 5, num_tokens)[:, None, None]
    k = (torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen) * magnitudes).to(dtype)
    v = (torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen) * 3 * magnitudes).to(dtype)
    k_cache = torch.zeros((4, 16, num_kv_heads, head_dim), dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(4 * 16, generator=gen)[:num_tokens]
    write_kv(k, v, k_cache, v_cache, slots)
    for cache, rows in ((k_cache, k), (v_cache, v)):
        stored = cache.view(-1, num_kv_heads, head_dim)[slots].float()
        assert torch.equal(stored, to_cache(rows, cache_dtype).float())  # values: -0 and +0 alike
        assert stored.abs().max() == torch.finfo(cache_dtype).max or cache_dtype == torch.float8_e5m2
