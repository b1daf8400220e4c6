"""Which schedule a timed `LLMEngine.step()` call stands for, async scheduling included.

A plain step schedules a batch, runs it and waits for its tokens: the call's wall time is that
schedule's. With async scheduling a call schedules and launches the next batch and then waits for
the previous batch's tokens, so its wall time is mostly the *previous* schedule's device time, and
a call that waits for two (the previous batch's tokens, then its own, when its batch could not run
ahead) covers both. Tools that time steps from outside (the GPU acceptance's served phase,
`corral calibrate`) hand each call here and get back each finished step with the schedules it
covers; pure, no clock of its own. (Async scheduling is for GPUs: on a CPU forced into it, the
forward pass runs inside the call that launches it, and this attribution is a step off.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Schedule = Sequence[Any]  # what `last_schedule` holds: the ScheduledSeq of one batch


@dataclass(frozen=True)
class TimedStep:
    """Wall time from launching `schedules[0]` to having the tokens of every one on the host."""

    schedules: tuple[Schedule, ...]
    seconds: float


class StepClock:
    def __init__(self) -> None:
        self._open: tuple[Schedule, float] | None = None  # launched, its tokens not waited for yet

    def record(self, schedule: Schedule, seconds: float, in_flight: bool) -> TimedStep | None:
        """One `step()` call: the schedule it launched (`last_schedule`, empty when it launched
        none), its wall time, and whether it returned with that schedule still running
        (`step_in_flight`). Returns the step whose tokens this call waited for, if any."""
        open_, self._open = self._open, None
        if open_ is None:
            if not schedule:
                return None
            if in_flight:
                self._open = (schedule, seconds)  # its device time lands in the next call
                return None
            return TimedStep((schedule,), seconds)
        waited, before = open_
        if in_flight and schedule:
            self._open = (schedule, 0.0)
            return TimedStep((waited,), before + seconds)
        return TimedStep((waited, schedule) if schedule else (waited,), before + seconds)
