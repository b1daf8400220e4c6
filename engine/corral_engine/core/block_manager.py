"""The paged KV block pool: allocation with reference counts and a prefix cache.

Blocks hold `block_size` tokens of KV. A full block is identified by a hash chained over the
token ids of every block before it (and over the request's LoRA adapter, whose KV differs from the
base model's for the same tokens, and over the content of any image whose placeholder tokens it
holds), so equal hashes mean equal prefixes. Blocks nothing references
but whose content is cached stay reusable until reclaimed (LRU); they count as free.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from corral_engine.core.sequence import Sequence

_ROOT_HASH = 0x9E3779B97F4A7C15  # parent hash of the first block


def chain_hash(parent_hash: int, token_ids: Iterable[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


def image_keys(seq: Sequence, start: int, end: int) -> tuple[bytes, ...]:
    """The content hashes of the request's images whose placeholders overlap tokens [start, end):
    equal tokens with other images must not share blocks."""
    return tuple(m.content_hash for m in seq.request.mm_inputs if m.offset < end and start < m.end)


def root_hash(seq: Sequence) -> int:
    """The parent hash of a sequence's first block: the adapter's own chain for a LoRA request."""
    lora = seq.request.lora
    return _ROOT_HASH if lora is None else hash((_ROOT_HASH, "lora", lora.lora_id))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing cached
        self._cached: dict[int, int] = {}  # block hash -> block id (referenced or not)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached ids, oldest first
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found there

    # -- accounting -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free plus reclaimable cached ones."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage_ratio(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    # -- block life cycle -----------------------------------------------------------------------
    def _take(self) -> int:
        if self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # reclaim the least recently used
            block = self.blocks[block_id]
            if block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None  # most recently used end
            else:
                self._free_ids.append(block_id)

    # -- prefix cache ---------------------------------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        has_images = bool(seq.request.mm_inputs)
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(seq)
            keys = image_keys(seq, i * bs, (i + 1) * bs) if has_images else ()
            hashes.append(
                chain_hash(hash((parent, keys)) if keys else parent, seq.token_ids[i * bs : (i + 1) * bs])
            )

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the longest cached prefix of `seq`, leaving at least one token to
        compute (its logits are needed). A pure lookup: see `record_prefix_query`."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._ensure_hashes(seq, max_blocks)
        found: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.num_prefix_queries += num_tokens
            self.num_prefix_hits += num_hit_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        self._ensure_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                self._cached[block_hash] = block.block_id
                block.block_hash = block_hash
            # else: cached already (shared) or an identical copy is; this one stays private.
        seq.num_registered_blocks = num_full

    # -- per-sequence operations ----------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def adopt_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give a sequence with no blocks the cached `block_ids` as its computed prefix."""
        for block_id in block_ids:
            self._ref(block_id)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        seq.num_registered_blocks = len(block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the block table cover `num_new_tokens` more tokens; False (nothing taken) if short."""
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full, computed prompt blocks with a sibling (n > 1). The child
        recomputes the rest, at least its last prompt token, so shared blocks are never written."""
        num_shared = min(
            (child.num_tokens - 1) // self.block_size, parent.num_computed_tokens // self.block_size
        )
        self.adopt_prefix(child, parent.block_table[:num_shared])

    def free(self, seq: Sequence) -> None:
        # Tail first, so the prefix's blocks are the last to be reclaimed.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError if accounting is inconsistent (tests call this after every step)."""
        refs = [0] * self.num_blocks
        owners: dict[int, Sequence] = {}
        bs = self.block_size
        for seq in live:
            for i, block_id in enumerate(seq.block_table):
                refs[block_id] += 1
                other = owners.setdefault(block_id, seq)
                if other is not seq and (
                    other.token_ids[: (i + 1) * bs] != seq.token_ids[: (i + 1) * bs]
                    or root_hash(other) != root_hash(seq)
                    or image_keys(other, 0, (i + 1) * bs) != image_keys(seq, 0, (i + 1) * bs)
                ):
                    raise AssertionError(f"block {block_id} shared by sequences with different prefixes")
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref {block.ref_count} != {refs[block.block_id]}"
                )
        num_referenced = sum(1 for r in refs if r)
        if len(self._free_ids) + len(self._evictable) + num_referenced != self.num_blocks:
            raise AssertionError("free + cached + used != total")
        if set(self._free_ids) & set(self._evictable):
            raise AssertionError("a block is both free and cached")
