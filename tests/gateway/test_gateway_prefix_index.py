"""The prefix index: which replica was sent how many of a prompt's leading blocks (pure)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from corral_gateway.prefix_index import PrefixIndex


def walk(index: PrefixIndex, urls: Sequence[str], block_hashes: Sequence[int]) -> dict[str, int]:
    """The definition: per replica, the leading blocks it holds, one block at a time."""
    out = {}
    for url in urls:
        num_held = 0
        for h in block_hashes:
            if url not in index._where.get(h, set()):
                break
            num_held += 1
        out[url] = num_held
    return out


def test_matched_blocks_counts_each_replicas_leading_blocks() -> None:
    index = PrefixIndex()
    index.remember("a", (1, 2, 3, 4))
    index.remember("b", (1, 2, 9))
    index.remember("c", (5,))
    assert index.matched_blocks(["a", "b", "c", "d"], (1, 2, 3, 4, 6)) == {"a": 4, "b": 2, "c": 0, "d": 0}
    assert index.matched_blocks(["a", "b"], (1, 2, 3, 4)) == {"a": 4, "b": 2}
    assert index.matched_blocks(["a", "b"], ()) == {"a": 0, "b": 0}
    assert index.matched_blocks(["a"], (7, 1)) == {"a": 0}  # a hole stops the walk


def test_matched_blocks_agrees_with_the_block_by_block_walk_on_random_fleets() -> None:
    rng = random.Random(1)
    urls = [f"r{i}" for i in range(12)]
    for _ in range(30):
        index = PrefixIndex(max_blocks_per_replica=rng.choice([8, 40, 10_000]))
        for _ in range(60):  # prompts drawn from a few shared heads, so replicas share blocks
            head = [rng.randrange(6) for _ in range(rng.randrange(8))]
            index.remember(rng.choice(urls), [*head, *(rng.randrange(100) for _ in range(4))])
        for _ in range(20):
            prompt = [rng.randrange(6) for _ in range(rng.randrange(10))]
            asked = rng.sample(urls, rng.randrange(1, len(urls)))
            assert index.matched_blocks(asked, prompt) == walk(index, asked, prompt)


def test_remember_keeps_holders_and_evicts_the_oldest_blocks() -> None:
    index = PrefixIndex(max_blocks_per_replica=3)
    index.remember("a", (1, 2, 3))
    index.remember("a", (1,))  # 1 is now the newest; 2 goes first
    index.remember("a", (4,))
    assert index.matched_blocks(["a"], (1,)) == {"a": 1}
    assert index.matched_blocks(["a"], (2,)) == {"a": 0}
    assert 2 not in index._where  # no holder left: the block is gone from the index
    index.remember("b", (3, 4))
    assert index._where[3] == {"a", "b"}
