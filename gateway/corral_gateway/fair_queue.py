"""A bounded queue ordered by priority, fair across API keys within a priority (pure, no I/O).

Higher priority first; within one priority, keys take turns (round-robin), FIFO within a key, so
one key's burst cannot starve another key's single request. Nor can it take every place: a
request arriving at a full queue may take the place of a lower priority's, or at its own priority
that of the newest request of a key holding more places than its own (`evict_for`). An item the
queue's user could not take while it took later ones is held (`hold`): it keeps its place, first
at its priority, until taken.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


def _in_turns(queues: Sequence[Sequence[T]], is_skipped: Callable[[T], bool]) -> Iterator[T]:
    """Keys taking turns: each key's first item not skipped, in key order, then each one's next, and
    so on. The caller may remove the item just given from its queue: the walk goes on as it was."""
    cursors = [0] * len(queues)
    is_given = True
    while is_given:
        is_given = False
        for n, items in enumerate(queues):
            at = cursors[n]
            while at < len(items) and is_skipped(items[at]):
                at += 1
            if at < len(items):
                item = items[at]
                yield item
                is_given = True
                if at < len(items) and items[at] is item:  # still there: step past it
                    at += 1
            cursors[n] = at


class FairQueue(Generic[T]):
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self._levels: dict[int, OrderedDict[str, deque[T]]] = {}
        self._where: dict[int, tuple[int, str]] = {}  # id(item) -> (priority, key)
        self._num_by_key: dict[str, int] = {}  # queued items per key, every priority together
        self._held: dict[int, T] = {}  # id(item) -> item: those passed over (`hold`), in that order

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

    def ordered(self) -> Iterator[T]:
        """Every item, lazily, in the order successive `pop`s give them: higher priority first;
        within one, the held items (keys taking turns, each key's in the order held), then the
        others (keys taking turns, FIFO within a key). The caller may take or remove the item just
        given and go on."""
        for priority in sorted(self._levels, reverse=True):
            keys = self._levels.get(priority)
            if keys is None:
                continue
            held: dict[str, list[T]] = {}
            for item in self._held.values():
                at, key = self._where[id(item)]
                if at == priority:
                    held.setdefault(key, []).append(item)
            yield from _in_turns([held[k] for k in keys if k in held], lambda item: False)
            yield from _in_turns(list(keys.values()), lambda item: id(item) in self._held)

    def peek(self) -> T | None:
        return next(self.ordered(), None)

    def pop(self) -> T | None:
        item = self.peek()
        if item is not None:
            self.take(item)
        return item

    def take(self, item: T) -> None:
        """Remove a queued `item` as served: its key has had its turn, and goes behind the other
        keys waiting at its priority."""
        priority, key = self._where[id(item)]
        self.remove(item)
        keys = self._levels.get(priority)
        if keys is not None and key in keys:
            keys.move_to_end(key)

    def hold(self, item: T) -> bool:
        """`item` could not be taken while later ones may be: it keeps its place ahead of the items
        of its priority not held, however keys take turns, and leaves its key's turns to the key's
        other items, until it is taken or removed. False when it was held already."""
        if id(item) in self._held or id(item) not in self._where:
            return False
        self._held[id(item)] = item
        return True

    def remove(self, item: T) -> bool:
        where = self._where.pop(id(item), None)
        if where is None:
            return False
        priority, key = where
        self._held.pop(id(item), None)
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
