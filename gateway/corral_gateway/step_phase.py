"""When a replica's engine steps end, as seen from the chunks the gateway relays (pure, no I/O).

An engine hands every running stream its tokens at the end of a step, so the chunks of all of a
replica's streams arrive together, once a step. From their arrival times this keeps the last step
end seen and a smoothed interval between step ends; a request sent there now waits for the rest of
the step in flight before the engine can schedule it. The caller passes the time, on the clock the
routing policy reads (the simulator's virtual clock, or the gateway's monotonic one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A step's chunks come in a burst (relaying one step's chunks of many streams takes the gateway a
# little while): a chunk starts the next step once it comes at least `MIN_GAP_S` after the chunk
# before it and at least `MIN_STEP_SHARE` of the interval after the step's first chunk.
MIN_GAP_S = 0.001
MIN_STEP_SHARE = 0.4
# A longer interval is not a step: the replica was idle or had no streams.
MAX_STEP_S = 0.5
# One interval moves the estimate at most toward this many times the estimate (a step whose
# chunks were missed, or a long prefill step, is not a new rhythm; a real slowdown still gets in).
MAX_GROWTH = 3.0
SMOOTHING = 0.2  # weight of each new interval
# No chunk for this many intervals: the replica went quiet, its phase is unknown.
STALE_STEPS = 3.0


@dataclass(slots=True)
class StepPhase:
    last_step_end_s: float = -math.inf  # the first chunk of the latest step seen
    last_chunk_s: float = -math.inf
    step_s: float = 0.0  # smoothed interval between step ends; 0 until two steps were seen

    def on_chunk(self, now_s: float) -> None:
        """A streamed chunk from the replica was relayed at `now_s`. Called per chunk: most calls
        are a later chunk of the same step and return after two subtractions and a store."""
        gap_s = now_s - self.last_chunk_s
        self.last_chunk_s = now_s
        step_s = self.step_s
        since_s = now_s - self.last_step_end_s
        if gap_s < MIN_GAP_S or since_s < MIN_STEP_SHARE * step_s:
            return
        if since_s <= MAX_STEP_S:
            if step_s == 0.0:
                self.step_s = since_s
            else:
                self.step_s = step_s + SMOOTHING * (min(since_s, MAX_GROWTH * step_s) - step_s)
        self.last_step_end_s = now_s

    def time_left_s(self, now_s: float) -> float | None:
        """Seconds until the step in flight should end (0 once it is due), or None when unknown:
        no interval yet, or no chunk for `STALE_STEPS` intervals (idle, or only non-streamed
        responses)."""
        step_s = self.step_s
        if step_s == 0.0 or now_s - self.last_chunk_s > STALE_STEPS * step_s:
            return None
        return max(0.0, step_s - (now_s - self.last_step_end_s))
