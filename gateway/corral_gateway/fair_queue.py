"""A bounded queue ordered by priority, fair across API keys within a priority (pure, no I/O).

Higher priority first; within one priority, keys take turns (round-robin), FIFO within a key, so
one key's burst cannot starve another key's single request. Nor can it take every place: a
request arriving at a full queue may take the place of a lower priority's, or at its own priority
that of the newest request of a key holding more places than its own (`evict_for`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self._levels: dict[int, OrderedDict[str, deque[T]]] = {}
        self._where: dict[int, tuple[int, str]] = {}  # id(item) -> (priority, key)
        self._num_by_key: dict[str, int] = {}  # queued items per key, every priority together

    def __len__(self) -> int:
        return len(self._where)

    @property
    def is_full(self) -> bool:
        return len(self._where) >= self.max_len

    def push(self, item: T, priority: int = 0, key: str = "") -> bool:
        """Enqueue; False (and nothing changes) when the queue is full."""
        if self.is_full:
            return False
        keys = self._levels.setdefault(priority, OrderedDict())
        keys.setdefault(key, deque()).append(item)
        self._where[id(item)] = (priority, key)
        self._num_by_key[key] = self._num_by_key.get(key, 0) + 1
        return True

    def evict_for(self, priority: int, key: str) -> T | None:
        """Make room in a full queue for one item of `key` at `priority`, taking the place of the
        newest item of the key holding the most items, at the lowest priority queued: any place
        below `priority`; at `priority` itself only when that key holds at least two more than
        `key` (so places move towards equal shares, never back and forth); never a place above.
        Returns the item removed; None, and nothing changes, when no place is given up."""
        if not self.is_full:
            return None
        level = min(self._levels)
        if level > priority:
            return None
        keys = self._levels[level]
        heaviest = max(keys, key=lambda k: self._num_by_key[k])  # the first in turn of equals
        if level == priority and self._num_by_key[heaviest] <= self._num_by_key.get(key, 0) + 1:
            return None
        victim = keys[heaviest][-1]
        self.remove(victim)
        return victim

    def peek(self) -> T | None:
        if not self._levels:
            return None
        keys = self._levels[max(self._levels)]
        return next(iter(keys.values()))[0]

    def pop(self) -> T | None:
        if not self._levels:
            return None
        priority = max(self._levels)
        keys = self._levels[priority]
        key, items = next(iter(keys.items()))
        item = items.popleft()
        del self._where[id(item)]
        self._forget_one(key)
        if items:
            keys.move_to_end(key)  # this key had its turn
        else:
            del keys[key]
        if not keys:
            del self._levels[priority]
        return item

    def remove(self, item: T) -> bool:
        where = self._where.pop(id(item), None)
        if where is None:
            return False
        priority, key = where
        self._forget_one(key)
        keys = self._levels[priority]
        items = keys[key]
        # By identity: two queued requests may compare equal.
        del items[next(i for i, queued in enumerate(items) if queued is item)]
        if not items:
            del keys[key]
        if not keys:
            del self._levels[priority]
        return True

    def _forget_one(self, key: str) -> None:
        if self._num_by_key[key] > 1:
            self._num_by_key[key] -= 1
        else:
            del self._num_by_key[key]
