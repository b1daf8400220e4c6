"""Pure unit tests of the paged block pool: ref counts, prefix cache, LRU reclaim, fork."""

from __future__ import annotations

from corral_engine.core.block_manager import BlockManager
from corral_engine.core.sequence import Request, Sequence
from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams


def make_seq(tokens: list[int], seq_id: int = 0, max_tokens: int = 4) -> Sequence:
    request = Request(
        f"r{seq_id}", tokens, SamplingParams(max_tokens=max_tokens), seq_id, RequestMetrics(0.0)
    )
    seq = Sequence(seq_id, request, 0, list(tokens), len(tokens))
    request.seqs = [seq]
    return seq


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    assert bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)


def test_allocate_and_free_return_everything() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_allocation_fails_without_taking_anything() -> None:
    bm = BlockManager(2, 4)
    seq = make_seq(list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(list(range(12)), 0)
    compute_all(bm, a)
    b = make_seq(list(range(12)), 1)  # identical prompt: 3 full blocks, but the last token is recomputed
    hit = bm.match_prefix(b)
    assert hit == a.block_table[:2]
    c = make_seq([*range(8), 99, 98, 97, 96, 1], 2)
    assert bm.match_prefix(c) == a.block_table[:2]
    d = make_seq([5, *range(1, 12)], 3)  # differs in the first block: chained hash misses everything
    assert bm.match_prefix(d) == []


def test_shared_blocks_are_ref_counted_and_cached_blocks_count_as_free() -> None:
    bm = BlockManager(6, 4)
    a = make_seq(list(range(9)), 0)
    compute_all(bm, a)
    b = make_seq(list(range(9)), 1)
    bm.adopt_prefix(b, bm.match_prefix(b))
    assert bm.allocate(b, b.num_uncomputed_tokens)
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 2
    assert bm.usage_ratio == 0.0
    bm.check_invariants([])


def test_lru_reclaims_cached_blocks_tail_first() -> None:
    bm = BlockManager(4, 4)
    a = make_seq(list(range(16)), 0)
    compute_all(bm, a)
    first, second = a.block_table[0], a.block_table[1]
    bm.free(a)
    b = make_seq([100 + i for i in range(8)], 1)
    assert bm.allocate(b, 8)  # reclaims two cached blocks: the tail of `a` goes first
    assert first not in b.block_table and second not in b.block_table
    c = make_seq(list(range(16)), 2)
    assert bm.match_prefix(c) == [first, second]


def test_fork_shares_only_full_computed_prompt_blocks() -> None:
    bm = BlockManager(8, 4)
    parent = make_seq(list(range(10)), 0)
    compute_all(bm, parent)
    child = make_seq(list(range(10)), 1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed_tokens == 8 and child.num_uncomputed_tokens == 2
    bm.check_invariants([parent, child])


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(list(range(12)), 0)
    compute_all(bm, a)
    assert bm.match_prefix(make_seq(list(range(12)), 1)) == []
    bm.free(a)
    assert bm.num_cached_free_blocks == 0
