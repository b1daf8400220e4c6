"""Prefill this gateway sent each replica whose first token has not come back yet (pure).

A load sample counts requests, not the prompt tokens still to compute, and a request it shows as
running may be in the middle of its prompt: a 4,000-token document is one step of 100 ms or more
on an H100, and every request sent there meanwhile waits for that step to end. The ledger keeps,
per replica and in the order sent, the prompt blocks it was sent that it had not cached (the prefix
index's view), and settles the oldest as the replica's responses' first bytes come back
(`Replica.num_first_bytes`): an engine admits its queue first come, first served, so first tokens
come back in about that order. A request that ended without a first byte (a failure) no longer
counts once fewer requests are in flight than records are kept. A queue the replica reports beyond
these (other gateways' requests) is priced at the mean request's blocks. Each record keeps when it
was sent, on the routing policy's clock: those sent since the replica's step in flight began have
not started, and its next step computes them together with whatever is sent now.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from corral_gateway.registry import Replica, ReplicaLoad


@dataclass(slots=True)
class _Pending:
    num_first_bytes: int  # the replica's count when last settled
    blocks: deque[float] = field(default_factory=deque)  # per request, oldest first
    sent_s: deque[float] = field(default_factory=deque)  # when each was sent
    num_blocks: float = 0.0  # their sum


class PrefillLedger:
    def __init__(self, smoothing: float = 0.01) -> None:
        self._smoothing = smoothing  # weight of each new request in the mean blocks per request
        self._pending: dict[tuple[str, str], _Pending] = {}
        self.mean_blocks_per_request: float | None = None

    def pending_blocks(self, replica: Replica, load: ReplicaLoad) -> float:
        """Blocks to prefill before a request sent now starts: those sent and not yet answered,
        plus any reported queue beyond them at the mean request's blocks."""
        return self.pending(replica, load, math.inf)[0]

    def num_sent_since(self, replica: Replica, since_s: float) -> int:
        """Requests sent to the replica after `since_s` whose first bytes have not come back."""
        return _num_sent_since(self._settle(replica), since_s)

    def pending(self, replica: Replica, load: ReplicaLoad, since_s: float) -> tuple[float, int]:
        """`pending_blocks` and `num_sent_since` at once (one settlement: routing asks per candidate)."""
        pending = self._settle(replica)
        queued_elsewhere = max(0.0, load.num_waiting_reported - len(pending.blocks))
        num_blocks = pending.num_blocks + queued_elsewhere * (self.mean_blocks_per_request or 0.0)
        return num_blocks, _num_sent_since(pending, since_s)

    def record(self, replica: Replica, num_blocks: float, now_s: float) -> None:
        """`num_blocks` of prompt the replica must compute were sent to it at `now_s` (before the
        caller's `on_dispatch`)."""
        pending = self._settle(replica)
        pending.blocks.append(num_blocks)
        pending.sent_s.append(now_s)
        pending.num_blocks += num_blocks
        mean = self.mean_blocks_per_request
        self.mean_blocks_per_request = (
            num_blocks if mean is None else mean + self._smoothing * (num_blocks - mean)
        )

    @property
    def num_replicas(self) -> int:
        """Replicas with records kept."""
        return len(self._pending)

    def forget(self, replica: Replica) -> None:
        """The replica left the registry: its records go with it (a replica that comes back at the
        same address starts afresh)."""
        self._pending.pop((replica.model, replica.url), None)

    def _settle(self, replica: Replica) -> _Pending:
        key = (replica.model, replica.url)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(replica.num_first_bytes)
        num_answered = replica.num_first_bytes - pending.num_first_bytes
        pending.num_first_bytes = replica.num_first_bytes
        blocks = pending.blocks
        while blocks and (num_answered > 0 or len(blocks) > replica.num_inflight):
            pending.num_blocks -= blocks.popleft()
            pending.sent_s.popleft()
            num_answered -= 1
        if not blocks:
            pending.num_blocks = 0.0  # no float drift once nothing is pending
        return pending


def _num_sent_since(pending: _Pending, since_s: float) -> int:
    num = 0
    for sent_s in reversed(pending.sent_s):  # newest first
        if sent_s <= since_s:
            break
        num += 1
    return num
