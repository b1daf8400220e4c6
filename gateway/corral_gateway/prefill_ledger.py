"""Prefill this gateway sent each replica whose first token has not come back yet (pure).

A load sample counts requests, not the prompt tokens still to compute, and a request it shows as
running may be in the middle of its prompt: a 4,000-token document is one step of 100 ms or more
on an H100, and every request sent there meanwhile waits for that step to end. The ledger keeps,
per replica and in the order sent, the prompt blocks it was sent that it had not cached (the prefix
index's view) and when, and settles the oldest as the replica's responses' first bytes come back
(`Replica.num_first_bytes`, `Replica.last_first_byte_s`): an engine admits its queue first come,
first served, so first tokens come back in about that order. A request that ended without a first
byte (a failure) no longer counts once fewer requests are in flight than records are kept. A queue
the replica reports beyond these (other gateways' requests) is priced at the mean request's blocks.

Pending blocks also drain with time: each settlement says how long the replica took for the blocks
it answered, from when it could start them (sent, or the previous first byte, whichever is later)
to their first byte; a fit over those, time = overhead + blocks / rate, lets the oldest record's
blocks run down once the overhead has passed. Records still go only with first bytes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from corral_gateway.registry import Replica, ReplicaLoad

# A fit needs this many settlements before it drains anything.
MIN_SAMPLES = 8
# Settlements closer than this to the one before were computed in the same step: no sample.
MIN_SAMPLE_S = 0.001


@dataclass(slots=True)
class PrefillFit:
    """Seconds from when a replica could start a prompt to its first byte, against the prompt's
    blocks: a least-squares line with exponential forgetting, `smoothing` the weight of each new
    settlement."""

    smoothing: float = 0.02
    num_samples: int = 0
    mean_blocks: float = 0.0
    mean_s: float = 0.0
    mean_blocks_sq: float = 0.0
    mean_blocks_s: float = 0.0

    def add(self, num_blocks: float, duration_s: float) -> None:
        self.num_samples += 1
        w = max(self.smoothing, 1.0 / self.num_samples)  # the first samples count equally
        self.mean_blocks += w * (num_blocks - self.mean_blocks)
        self.mean_s += w * (duration_s - self.mean_s)
        self.mean_blocks_sq += w * (num_blocks * num_blocks - self.mean_blocks_sq)
        self.mean_blocks_s += w * (num_blocks * duration_s - self.mean_blocks_s)

    def line(self) -> tuple[float, float] | None:
        """(overhead_s, blocks_per_s), or None while too few settlements or no slope."""
        if self.num_samples < MIN_SAMPLES:
            return None
        var = self.mean_blocks_sq - self.mean_blocks**2
        cov = self.mean_blocks_s - self.mean_blocks * self.mean_s
        if var <= 1e-9 * max(1.0, self.mean_blocks_sq) or cov <= 0.0:
            return None
        s_per_block = cov / var
        overhead_s = min(self.mean_s, max(0.0, self.mean_s - s_per_block * self.mean_blocks))
        return overhead_s, 1.0 / s_per_block


@dataclass(slots=True)
class _Pending:
    num_first_bytes: int  # the replica's count when last settled
    last_first_byte_s: float = -math.inf  # the replica's latest first byte when last settled
    blocks: deque[float] = field(default_factory=deque)  # per request, oldest first
    sent_s: deque[float] = field(default_factory=deque)  # when each was sent
    num_blocks: float = 0.0  # their sum
    fit: PrefillFit = field(default_factory=PrefillFit)


class PrefillLedger:
    def __init__(
        self, smoothing: float = 0.01, is_draining: bool = True, is_per_replica: bool = True
    ) -> None:
        self._smoothing = smoothing  # weight of each new request in the mean blocks per request
        self._pending: dict[tuple[str, str], _Pending] = {}
        self.mean_blocks_per_request: float | None = None
        self.is_draining = is_draining
        self.is_per_replica = is_per_replica
        self.fleet_fit = PrefillFit()

    def pending_blocks(self, replica: Replica, load: ReplicaLoad, now_s: float) -> float:
        """Blocks to prefill before a request sent now starts: those sent and not yet answered,
        less what the replica computed of them by `now_s` at its fitted rate, plus any reported
        queue beyond them at the mean request's blocks."""
        pending = self._settle(replica)
        queued_elsewhere = max(0.0, load.num_waiting_reported - len(pending.blocks))
        return self._left(pending, now_s) + queued_elsewhere * (self.mean_blocks_per_request or 0.0)

    def line(self, replica: Replica) -> tuple[float, float] | None:
        """The replica's fitted (overhead_s, blocks_per_s), the fleet's until it has its own."""
        pending = self._pending.get((replica.model, replica.url))
        own = pending.fit.line() if pending is not None and self.is_per_replica else None
        return own or self.fleet_fit.line()

    def _left(self, pending: _Pending, now_s: float) -> float:
        if not pending.blocks or not self.is_draining:
            return pending.num_blocks
        line = self._pending_line(pending)
        if line is None:
            return pending.num_blocks
        overhead_s, blocks_per_s = line
        busy_s = now_s - max(pending.sent_s[0], pending.last_first_byte_s) - overhead_s
        return max(0.0, pending.num_blocks - blocks_per_s * max(0.0, busy_s))

    def _pending_line(self, pending: _Pending) -> tuple[float, float] | None:
        own = pending.fit.line() if self.is_per_replica else None
        return own or self.fleet_fit.line()

    def num_sent_since(self, replica: Replica, since_s: float) -> int:
        """Requests sent after `since_s` whose first token has not come back."""
        pending = self._settle(replica)
        num = 0
        for sent_s in reversed(pending.sent_s):
            if sent_s <= since_s:
                break
            num += 1
        return num

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
            pending = self._pending[key] = _Pending(replica.num_first_bytes, replica.last_first_byte_s)
        num_answered = replica.num_first_bytes - pending.num_first_bytes
        pending.num_first_bytes = replica.num_first_bytes
        blocks, sent_s = pending.blocks, pending.sent_s
        if num_answered > 0:
            start_s = max(sent_s[0], pending.last_first_byte_s) if blocks else math.inf
            num_settled = 0.0
            while blocks and num_answered > 0:
                num_settled += blocks.popleft()
                sent_s.popleft()
                num_answered -= 1
            end_s = replica.last_first_byte_s
            pending.last_first_byte_s = end_s
            if end_s - start_s >= MIN_SAMPLE_S:
                pending.fit.add(num_settled, end_s - start_s)
                self.fleet_fit.add(num_settled, end_s - start_s)
            pending.num_blocks -= num_settled
        while blocks and len(blocks) > replica.num_inflight:
            pending.num_blocks -= blocks.popleft()
            sent_s.popleft()
        if not blocks:
            pending.num_blocks = 0.0  # no float drift once nothing is pending
        return pending
