"""`--max-waiting` under a burst, for each front (in-process thread, core process, simulator): the
limit bounds the requests that will not run at the next step, so with `max_num_seqs` S and
`max_waiting` W a burst gets exactly S + W admitted, wherever the step loop is when it arrives
(idle, between taking requests in and stepping them, or behind a pipe)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import threading
from collections.abc import AsyncIterator, Callable

import pytest
from corral_engine import AsyncEngine, EngineArgs, EngineCoreClient, SamplingParams
from corral_engine.errors import QueueFullError
from corral_engine.outputs import RequestOutput
from corral_engine.sim.async_engine import AsyncSimEngine
from corral_engine.sim.engine import NullTokenizer, SimEngine
from corral_engine.sim.perf_model import Fitted, Profile

MAX_NUM_SEQS, MAX_WAITING = 4, 4
# Never finishes during a test: nothing leaves the batch while a burst is counted.
LONG = SamplingParams(max_tokens=200, ignore_eos=True)

Front = AsyncEngine | EngineCoreClient | AsyncSimEngine


def _burst(front: Front, prefix: str, n: int) -> list[AsyncIterator[RequestOutput]]:
    """`n` requests at once (no await between them): the streams of those admitted."""
    streams = []
    for i in range(n):
        with contextlib.suppress(QueueFullError):
            streams.append(front.add_request(f"{prefix}{i}", [1, 2, 3], LONG))
    return streams


async def _close(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]


async def _until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop (and the engine's threads) until `predicate` holds; no deadline: a hang is
    the test's timeout."""
    while not predicate():
        await asyncio.sleep(0.001)


def _args(model_dir: pathlib.Path) -> EngineArgs:
    return EngineArgs(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=128,
        max_num_seqs=MAX_NUM_SEQS,
        max_waiting=MAX_WAITING,
    )


class _StepGate:
    """Holds each step of an LLMEngine until the test lets it run: the step thread sits between
    taking requests in and stepping them for as long as the test needs."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._entered = threading.Semaphore(0)
        self._release = threading.Semaphore(0)
        self._is_open = False
        step = engine.engine.step

        def gated_step() -> list[RequestOutput]:
            self._entered.release()
            if not self._is_open:
                self._release.acquire()
            return step()

        engine.engine.step = gated_step  # type: ignore[method-assign]

    async def entered(self) -> None:
        await asyncio.to_thread(self._entered.acquire)

    def release_one(self) -> None:
        self._release.release()

    def open(self) -> None:
        self._is_open = True
        self._release.release()


async def test_in_process_engine_counts_requests_taken_in_but_not_stepped(
    tiny_model_dir: pathlib.Path,
) -> None:
    engine = AsyncEngine(_args(tiny_model_dir))
    gate = _StepGate(engine)
    await engine.start()
    streams = []
    try:
        streams += _burst(engine, "a", 1)
        await gate.entered()  # step 1 holds "a0"
        streams += _burst(engine, "b", 5)  # queued behind step 1
        gate.release_one()
        await gate.entered()  # step 1 done (one running); step 2 took the five in, not stepped yet
        assert engine.stats().num_running == 1 and engine.stats().num_waiting == 0
        streams += _burst(engine, "c", 40)
        assert len(streams) == MAX_NUM_SEQS + MAX_WAITING
        assert engine.num_waiting_now() == MAX_WAITING
    finally:
        gate.open()
        await _close(streams)
        await engine.shutdown()


async def test_in_process_engine_admits_a_burst_into_an_idle_engine(tiny_model_dir: pathlib.Path) -> None:
    """Requests that will run at the next step are not waiting: an idle engine takes S + W."""
    engine = AsyncEngine(_args(tiny_model_dir))
    gate = _StepGate(engine)
    await engine.start()
    streams = []
    try:
        streams = _burst(engine, "a", 40)
        assert len(streams) == MAX_NUM_SEQS + MAX_WAITING
        await gate.entered()
    finally:
        gate.open()
        await _close(streams)
        await engine.shutdown()


async def test_core_process_counts_requests_on_the_pipe(tiny_model_dir: pathlib.Path) -> None:
    engine = EngineCoreClient(_args(tiny_model_dir))
    await engine.start()
    streams = []
    pid = engine._process.pid
    assert pid is not None
    try:
        streams += _burst(engine, "a", 1)
        await _until(lambda: engine.stats().num_running == 1)  # the core took it in and stepped it
        os.kill(pid, signal.SIGSTOP)  # the burst waits on the pipe: no step reports it taken
        try:
            streams += _burst(engine, "b", 40)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert len(streams) == MAX_NUM_SEQS + MAX_WAITING
        # Once the core has them all: four run, four wait, and the limit still holds.
        await _until(lambda: (engine.stats().num_running, engine.stats().num_waiting) == (4, 4))
        assert engine.num_waiting_now() == MAX_WAITING
        assert not _burst(engine, "c", 3)
    finally:
        await _close(streams)
        await engine.shutdown()


def _sim_engine() -> AsyncSimEngine:
    profile = Profile(
        "test", Fitted((0.02, 0.0, 1e-4, 0.0, 0.0)), num_kv_blocks=512, max_num_seqs=MAX_NUM_SEQS
    )
    return AsyncSimEngine(SimEngine(profile, NullTokenizer(), "sim"), MAX_WAITING)


async def test_simulator_admits_a_burst_into_an_idle_engine_and_counts_aborts_while_queued() -> None:
    engine = _sim_engine()
    await engine.start()
    try:
        streams = _burst(engine, "a", 40)
        assert len(streams) == MAX_NUM_SEQS + MAX_WAITING
        for i in range(len(streams)):  # aborted while still queued for the step loop
            engine.abort(f"a{i}")
        assert await engine.wait_idle(30.0)
        assert engine.num_waiting_now() == 0
        streams = _burst(engine, "b", 40)  # nothing left over from the aborted burst
        assert len(streams) == MAX_NUM_SEQS + MAX_WAITING
        await _close(streams)
    finally:
        await engine.shutdown()


async def test_simulator_counts_requests_taken_in_during_a_step() -> None:
    engine = _sim_engine()
    await engine.start()
    streams = []
    try:
        streams += _burst(engine, "a", 4)
        await _until(lambda: not engine._adds)  # taken in; step 1 is under way
        streams += _burst(engine, "b", 4)  # four seats taken by now: these four wait
        # Step 1 ended (the four run) and step 2 took the next four in: the stats do not count them.
        await _until(lambda: not engine._adds and engine.stats().num_running == MAX_NUM_SEQS)
        assert engine.stats().num_waiting == 0
        streams += _burst(engine, "c", 40)
        assert len(streams) == MAX_NUM_SEQS + MAX_WAITING
    finally:
        await _close(streams)
        await engine.shutdown()


@pytest.mark.parametrize("max_waiting", [0, 2])
async def test_simulator_limit_counts_only_requests_beyond_the_batch(max_waiting: int) -> None:
    engine = _sim_engine()
    engine.max_waiting = max_waiting
    await engine.start()
    try:
        streams = _burst(engine, "a", 10)
        assert len(streams) == MAX_NUM_SEQS + max_waiting
        await _close(streams)
    finally:
        await engine.shutdown()
