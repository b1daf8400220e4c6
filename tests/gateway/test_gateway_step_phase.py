"""A replica's step phase, estimated from the times its streams' chunks are relayed."""

from __future__ import annotations

import pytest
from corral_gateway.step_phase import StepPhase


def feed(phase: StepPhase, step_ends_s: list[float], spread_s: tuple[float, ...] = (0.0,)) -> None:
    """Each step's chunks, one per stream, `spread_s` after its end."""
    for end_s in step_ends_s:
        for offset_s in spread_s:
            phase.on_chunk(end_s + offset_s)


def test_steps_are_seen_from_the_chunks_of_all_streams() -> None:
    phase = StepPhase()
    feed(phase, [10.0 + 0.020 * k for k in range(20)], spread_s=(0.0, 0.0, 0.0))  # 3 streams
    assert phase.step_s == pytest.approx(0.020)
    assert phase.last_step_end_s == pytest.approx(10.38)
    assert phase.time_left_s(10.385) == pytest.approx(0.015)
    assert phase.time_left_s(10.399) == pytest.approx(0.001)
    assert phase.time_left_s(10.41) == 0.0  # due


def test_one_steps_chunks_spread_over_a_little_time_are_one_step_from_its_first_chunk() -> None:
    phase = StepPhase()
    # 20 streams, relayed 0.4 ms apart: each step's chunks span 7.6 ms of its 30.
    feed(phase, [5.0 + 0.030 * k for k in range(20)], spread_s=tuple(0.0004 * i for i in range(20)))
    assert phase.step_s == pytest.approx(0.030)
    assert phase.last_step_end_s == pytest.approx(5.57)  # not the last stream's chunk
    assert phase.time_left_s(5.58) == pytest.approx(0.020)


def test_the_interval_follows_a_slowdown_but_not_one_long_step() -> None:
    phase = StepPhase()
    feed(phase, [1.0 + 0.020 * k for k in range(10)])  # last end 1.18
    phase.on_chunk(1.38)  # one 200 ms step (a long prompt): counted as 3 x 20 ms at most
    assert phase.step_s == pytest.approx(0.020 + 0.2 * (0.060 - 0.020))
    feed(phase, [1.38 + 0.040 * k for k in range(1, 30)])  # then steps of 40 ms
    assert phase.step_s == pytest.approx(0.040, rel=0.01)


def test_no_estimate_before_two_steps_nor_once_the_replica_went_quiet() -> None:
    phase = StepPhase()
    assert phase.time_left_s(0.0) is None
    feed(phase, [2.0], spread_s=(0.0, 0.0005))  # one step's chunks: no interval yet
    assert phase.time_left_s(2.001) is None
    feed(phase, [2.025, 2.05])
    assert phase.time_left_s(2.06) == pytest.approx(0.015)
    assert phase.time_left_s(2.05 + 3 * 0.025 + 0.001) is None  # no chunk for 3 steps: idle
    # Streams again after 10 s idle: the gap is not a step, the interval stays.
    feed(phase, [12.0, 12.025])
    assert phase.step_s == pytest.approx(0.025)
    assert phase.time_left_s(12.03) == pytest.approx(0.020)
