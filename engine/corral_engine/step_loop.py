"""The step loop both serving layouts run: requests and aborts queued from other threads, the engine
stepped while any request is unfinished, and everything a step produces handed to a sink.

`AsyncEngine` runs it on a thread beside the server's event loop (one process); `engine_core` runs
it on the main thread of a process of its own, its sink writing to a pipe. Either way the loop is
the same code: aborts first, then admissions, then a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Protocol

from corral_engine.core.sequence import Request
from corral_engine.errors import InvalidRequestError
from corral_engine.llm_engine import LLMEngine
from corral_engine.outputs import EngineStats, RequestOutput, StepLatencies

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class StepSink(Protocol):
    """Where the loop's results go; called on the loop's thread, must not block for long."""

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs outside a step (an aborted request's last one)."""

    def stepped(
        self,
        outputs: list[RequestOutput],
        duration_s: float,
        num_tokens: int,
        latencies: StepLatencies,
        stats: EngineStats,
    ) -> None:
        """One step ran: its outputs (maybe none), its duration, its batched tokens, the token
        latencies it added, the state after it."""

    def stats(self, stats: EngineStats) -> None:
        """The state while idle (and once more as the loop ends)."""

    def error(self, request_id: str, error: InvalidRequestError) -> None:
        """A queued request the engine refused."""

    def dropped(self, request_id: str) -> None:
        """An abort for a request the engine no longer holds: its stream ends without output."""

    def died(self, error: BaseException) -> None:
        """The loop failed; nothing more will come."""


class StepLoop:
    def __init__(self, engine: LLMEngine, sink: StepSink) -> None:
        self.engine = engine
        self._sink = sink
        self._adds: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._wakeup = threading.Event()
        self._running = True
        # Requests taken from `_adds` (each written by one thread only): the stats the loop hands on
        # carry their sum, so the front knows which of the requests it handed over they count.
        self._num_taken = 0
        self._num_refused = 0  # refused before they were queued (`refused`)

    def add(self, request: Request) -> None:
        """Thread-safe: the request joins the engine before the next step."""
        self._adds.append(request)
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the start of the next step."""
        self._aborts.append(request_id)
        self._wakeup.set()

    def refused(self) -> None:
        """From the one thread that adds: a request handed over for this loop was refused before
        it could be added; it counts as taken."""
        self._num_refused += 1

    def _stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.num_requests_taken_total = self._num_taken + self._num_refused
        return stats

    def stop(self) -> None:
        """Thread-safe: `run` returns after the step in flight, with every request aborted."""
        self._running = False
        self._wakeup.set()

    def run(self) -> None:
        engine, sink = self.engine, self._sink
        try:
            while self._running:
                self._drain_inputs()
                if not engine.has_unfinished_requests():
                    sink.stats(self._stats())
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                started = time.perf_counter()
                outputs = engine.step()
                sink.stepped(
                    outputs,
                    time.perf_counter() - started,
                    engine.last_step_num_tokens,
                    engine.last_step_latencies,
                    self._stats(),
                )
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
        except BaseException as e:  # the step loop must report, not vanish
            logger.exception("engine step loop died")
            sink.died(e)
        finally:
            sink.stats(self._stats())

    def _drain_inputs(self) -> None:
        """Apply queued aborts and admissions. `_adds` is only ever popped here, never replaced:
        another thread appends to it meanwhile."""
        engine = self.engine
        dropped: set[str] = set()  # aborted while still queued: skipped below
        while self._aborts:
            request_id = self._aborts.popleft()
            output = engine.abort_request(request_id)
            if output is not None:
                self._sink.outputs([output])
            else:
                dropped.add(request_id)
                self._sink.dropped(request_id)
        while self._adds:
            request = self._adds.popleft()
            self._num_taken += 1
            if request.request_id in dropped:
                continue
            try:
                engine.insert_request(request)
            except InvalidRequestError as e:
                self._sink.error(request.request_id, e)
