"""A bounded queue ordered by priority, fair across API keys within a priority (pure, no I/O).

Higher priority first; within one priority, keys take turns (round-robin), FIFO within a key, so
one key's burst cannot starve another key's single request.
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
        return True

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
        keys = self._levels[priority]
        items = keys[key]
        # By identity: two queued requests may compare equal.
        del items[next(i for i, queued in enumerate(items) if queued is item)]
        if not items:
            del keys[key]
        if not keys:
            del self._levels[priority]
        return True
