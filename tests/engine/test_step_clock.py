"""corral_engine.step_clock: each timed `step()` call counted to the batch whose tokens it waited
for. Plain steps are their own; with async scheduling a call's time is the batch the call before
launched, and a call that could not run ahead covers two."""

from __future__ import annotations

import pathlib

from corral_engine.step_clock import StepClock, TimedStep

from tests.engine.helpers import make_engine, random_prompts
from tests.engine.test_async_scheduling import AHEAD, GREEDY, SYNC

A, B, C = ["a"], ["b"], ["c"]  # three batches (any non-empty sequence stands for one)


def test_plain_steps_are_their_own() -> None:
    clock = StepClock()
    assert clock.record(A, 1.0, in_flight=False) == TimedStep((A,), 1.0)
    assert clock.record([], 0.1, in_flight=False) is None  # nothing scheduled, nothing waited for
    assert clock.record(B, 2.0, in_flight=False) == TimedStep((B,), 2.0)


def test_a_call_that_runs_ahead_is_timed_by_the_next() -> None:
    clock = StepClock()
    assert clock.record(A, 0.5, in_flight=True) is None  # launched A, waited for nothing
    assert clock.record(B, 3.0, in_flight=True) == TimedStep((A,), 3.5)  # launched B, waited for A
    assert clock.record(C, 2.0, in_flight=False) == TimedStep((B, C), 2.0)  # waited for B, then C
    assert clock.record(A, 0.5, in_flight=True) is None
    assert clock.record([], 1.5, in_flight=False) == TimedStep((A,), 2.0)  # the last tokens only


def test_every_batch_of_a_real_engine_is_timed_once_in_order(tiny_model_dir: pathlib.Path) -> None:
    """The tiny model on CPU with async scheduling forced on, and plain: each scheduled batch is
    in exactly one timed step, in launch order, and only async scheduling defers any."""
    prompts = random_prompts(6, 500, seed=81, min_len=3, max_len=40)
    for settings, runs_ahead in ((SYNC, False), (AHEAD, True)):
        engine = make_engine(tiny_model_dir, settings=settings, max_num_seqs=4, max_num_batched_tokens=64)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY.replace(max_tokens=5 + 3 * i))
        clock, launched, timed, deferred, calls = StepClock(), [], [], 0, 0
        while engine.has_unfinished_requests():
            engine.step()
            calls += 1
            if engine.last_schedule:
                launched.append(engine.last_schedule)
            deferred += engine.step_in_flight
            step = clock.record(engine.last_schedule, 1.0, engine.step_in_flight)
            if step is not None:
                timed.append(step)
        assert [id(b) for step in timed for b in step.schedules] == [id(b) for b in launched]
        assert (deferred > 0) is runs_ahead
        assert sum(step.seconds for step in timed) == calls  # no call's time lost or counted twice
