"""Which replicas this gateway recently sent each prompt block to (pure): chained block hashes in,
per replica the number of leading blocks it has seen; oldest blocks forgotten per replica (LRU).

A replica that was sent a prompt's first k blocks probably still holds their KV, so it can skip
that part of the prefill. The llm-d scorer and prefix affinity both read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int = 31_250) -> None:
        self.max_blocks_per_replica = max_blocks_per_replica
        self._where: dict[int, set[str]] = {}  # block hash -> replicas it was sent to
        self._lru: dict[str, OrderedDict[int, None]] = {}  # replica -> its blocks, oldest first

    def matched_blocks(self, urls: Sequence[str], block_hashes: Sequence[int]) -> dict[str, int]:
        """Per replica, how many of the prompt's leading blocks it was sent."""
        matched = dict.fromkeys(urls, 0)
        alive = set(urls)
        for i, h in enumerate(block_hashes):
            alive &= self._where.get(h, set())
            if not alive:
                break
            for url in alive:
                matched[url] = i + 1
        return matched

    def remember(self, url: str, block_hashes: Sequence[int]) -> None:
        lru = self._lru.setdefault(url, OrderedDict())
        for h in block_hashes:
            lru[h] = None
            lru.move_to_end(h)
            self._where.setdefault(h, set()).add(url)
        while len(lru) > self.max_blocks_per_replica:
            old, _ = lru.popitem(last=False)
            holders = self._where.get(old)
            if holders is not None:
                holders.discard(url)
                if not holders:
                    del self._where[old]
