"""Prefill this gateway sent each replica that the replica's last load sample cannot show (pure).

A load sample counts requests, not the prompt tokens still to compute, and it is up to a poll
interval old. A replica just sent three long prompts that its cache lacks computes them in its next
steps, and every request sent there meanwhile waits behind them: its time to first token grows
with that work, not with the count of requests. The ledger keeps, per replica, the prompt blocks
sent to it since its last sample that it had not cached (the prefix index's view), and prices the
queue the sample reports at the mean of those blocks per request.
"""

from __future__ import annotations

from corral_gateway.registry import Replica, ReplicaLoad


class PrefillLedger:
    def __init__(self, smoothing: float = 0.01) -> None:
        self._smoothing = smoothing  # weight of each new request in the mean blocks per request
        self._sent: dict[str, tuple[float | None, float]] = {}  # url -> (its sample's time, blocks since)
        self.mean_blocks_per_request: float | None = None

    def pending_blocks(self, replica: Replica, load: ReplicaLoad) -> float:
        """Blocks to prefill before a request sent now starts: sent since the sample, plus the
        queue the sample reports at the mean request's blocks."""
        return self._sent_since_sample(replica) + load.num_waiting_reported * (
            self.mean_blocks_per_request or 0.0
        )

    def record(self, replica: Replica, num_blocks: float) -> None:
        """`num_blocks` of prompt the replica must compute were just sent to it."""
        self._sent[replica.url] = (_sample_at(replica), self._sent_since_sample(replica) + num_blocks)
        mean = self.mean_blocks_per_request
        self.mean_blocks_per_request = (
            num_blocks if mean is None else mean + self._smoothing * (num_blocks - mean)
        )

    def _sent_since_sample(self, replica: Replica) -> float:
        at_s, num_blocks = self._sent.get(replica.url, (None, 0.0))
        # A newer sample already counts what was sent before it (as running or waiting).
        return num_blocks if at_s == _sample_at(replica) else 0.0


def _sample_at(replica: Replica) -> float | None:
    return None if replica.sample is None else replica.sample.at_s
