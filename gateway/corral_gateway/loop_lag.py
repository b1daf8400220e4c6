"""The gateway's event-loop lag: a task that sleeps a fixed tick and measures how late it wakes
(`corral_gateway_event_loop_lag_seconds`), and whether a connect that timed out just now timed out
because the loop itself was stalled rather than because the replica did not answer."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from prometheus_client import Histogram

# How often the monitor wakes: 20 wakes a second cost the loop ~0.05% of a core, and a stall is
# measured to within a tick.
TICK_S = 0.05
# A connect timeout is the loop's own when the loop was late for at least this share of the
# timeout's span: a healthy replica's TCP handshake takes under a millisecond (a dropped SYN is
# resent after 1 s), so half of even a 2 s timeout on a running loop is ample time for one.
STALL_SHARE = 0.5


def stalled_within(
    samples: Iterable[tuple[float, float]], since_s: float, now_s: float, due_s: float | None
) -> float:
    """Seconds of [since_s, now_s] the loop was late. Each sample (woke_s, lag_s) covers
    [woke_s - lag_s, woke_s]; a wake due at `due_s` that has not come yet covers [due_s, now_s]."""
    total = sum(max(0.0, min(woke, now_s) - max(woke - lag, since_s)) for woke, lag in samples)
    if due_s is not None:
        total += max(0.0, now_s - max(due_s, since_s))
    return total


def is_loop_stall(stalled_s: float, timeout_s: float) -> bool:
    """Whether a connect that timed out after `timeout_s`, over whose span the loop was late for
    `stalled_s`, is the loop's fault: a connect the kernel had completed waited for the loop."""
    return stalled_s >= STALL_SHARE * timeout_s


class LoopLag:
    """Measures the running loop's lateness once `run` is running (nothing measured before)."""

    def __init__(self, histogram: Histogram, horizon_s: float, tick_s: float = TICK_S) -> None:
        self._histogram = histogram
        self._horizon_s = horizon_s  # the longest span `stalled_s` is asked about
        self._tick_s = tick_s
        self._samples: deque[tuple[float, float]] = deque()  # (woke_s, lag_s) of late wakes
        self._due_s: float | None = None  # when the sleeping monitor should wake

    async def run(self) -> None:
        """Sleep a tick at a time, observing each wake's lateness; runs until cancelled."""
        try:
            while True:
                self._due_s = time.monotonic() + self._tick_s
                await asyncio.sleep(self._tick_s)
                woke_s = time.monotonic()
                lag_s = max(0.0, woke_s - self._due_s)
                self._histogram.observe(lag_s)
                self._record(woke_s, lag_s)
        finally:
            self._due_s = None

    def _record(self, woke_s: float, lag_s: float) -> None:
        if lag_s > 0.0:
            self._samples.append((woke_s, lag_s))
        while self._samples and self._samples[0][0] < woke_s - self._horizon_s:
            self._samples.popleft()

    def stalled_s(self, span_s: float) -> float:
        """Seconds of the last `span_s` the loop was late, a stall still under way included."""
        now_s = time.monotonic()
        return stalled_within(self._samples, now_s - span_s, now_s, self._due_s)

    def is_stalled(self, timeout_s: float) -> bool:
        """Whether a connect timing out now after `timeout_s` timed out because the loop stalled."""
        return is_loop_stall(self.stalled_s(timeout_s), timeout_s)
