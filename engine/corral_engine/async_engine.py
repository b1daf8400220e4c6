"""The asyncio front: a step loop on its own thread, per-request output streams, thread-safe abort.

The model's forward pass blocks, so the engine steps on a dedicated thread while the event loop
keeps serving HTTP. Requests and aborts cross to the step thread through queues; outputs come back
through `loop.call_soon_threadsafe`, one callback per step for all requests. A request's consumer
that falls behind gets the outputs queued meanwhile merged into one.

The engine is built (weights loaded, KV cache allocated) on a thread that then exits, never on
the event loop's: see `_build_off_thread`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from corral_engine.args import EngineArgs
from corral_engine.errors import EngineDeadError, InvalidRequestError
from corral_engine.llm_engine import LLMEngine, Prompt
from corral_engine.outputs import EngineStats, RequestOutput
from corral_engine.request_streams import RequestStreams
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from corral_engine.step_loop import StepLoop

logger = logging.getLogger(__name__)


def _build_off_thread(args: EngineArgs, settings: EngineSettings | None) -> LLMEngine:
    """LLMEngine(args, settings), built on a short-lived thread.

    OpenMP keeps a team of worker threads for every thread that ran a parallel region, for that
    thread's whole life. Loading the model on the event loop's thread would leave its team idle
    beside the step thread's; libgomp then counts more of its threads than cores and stops spinning
    between regions altogether (its "throttled" spin count, 0 under OMP_WAIT_POLICY=PASSIVE), so
    nearly every op of every step ended with both threads asleep on a futex: served W2 at 0.90x of
    offline on 2 cores (docs/engine-speed.md, item 14). A loading thread's team goes when it exits,
    leaving the step thread's as the only one."""
    built: list[LLMEngine] = []
    failed: list[BaseException] = []

    def build() -> None:
        try:
            built.append(LLMEngine(args, settings))
        except BaseException as e:  # re-raised on the caller's thread
            failed.append(e)

    loader = threading.Thread(target=build, name="corral-engine-load")
    loader.start()
    loader.join()
    if failed:
        raise failed[0]
    return built[0]


class StreamFront:
    """The event loop's side of a step loop, whichever thread or process runs it: one output queue
    per request, filled through `loop.call_soon_threadsafe` from the thread that receives a step's
    results, one callback per step for all requests."""

    def __init__(self) -> None:
        self._streams = RequestStreams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = EngineStats()
        self._running = False  # between start and shutdown
        self._dead: BaseException | None = None  # why the step loop stopped on its own
        # Called after every step with (duration_s, num_batched_tokens), on the thread that
        # receives the step; must be thread-safe and quick (a Prometheus histogram observe is).
        self.on_step: Callable[[float, int], None] | None = None

    def stats(self) -> EngineStats:
        """The state after the last step, as vLLM reports it: `num_waiting` counts requests the
        scheduler could not start, not ones that arrived since and start at the next step (a
        router reading that burst as a queue would hold requests the engine has room for)."""
        return self._stats

    def _num_queued(self) -> int:
        """Requests handed to the step loop that it has not taken in yet."""
        return 0

    @property
    def is_running(self) -> bool:
        return self._running and self._dead is None

    def _check_admission(self, request_id: str, max_waiting: int | None) -> None:
        """EngineDeadError when nothing steps; a duplicate id or a full waiting queue refused."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        self._streams.check_new(request_id, max_waiting, self._stats.num_waiting + self._num_queued())

    async def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._streams and not self._num_queued():
                return True
            await asyncio.sleep(0.05)
        return not self._streams

    # -- from the receiving thread --------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put_outputs, outputs)

    def _put_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finished:  # the stream keeps its queue; the table must not
                    del self._streams[output.request_id]

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put_error, request_id, error)

    def _put_error(self, request_id: str, error: BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _deliver_dropped(self, request_id: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._streams.pop, request_id, None)

    def _step_done(
        self, outputs: list[RequestOutput], duration_s: float, num_tokens: int, stats: EngineStats
    ) -> None:
        if self.on_step is not None:
            self.on_step(duration_s, num_tokens)
        self._stats = stats
        if outputs:
            self._deliver(outputs)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        for request_id in list(self._streams):
            self._deliver_error(request_id, error)

    def _end_all_now(self, error: BaseException) -> None:
        """On the event loop, at shutdown: every stream still open ends with `error`."""
        for queue in self._streams.values():
            queue.put_nowait(error)


class _ThreadSink:
    """The step loop's results, from its thread to the front's event loop."""

    def __init__(self, front: AsyncEngine) -> None:
        self._front = front

    def outputs(self, outputs: list[RequestOutput]) -> None:
        self._front._deliver(outputs)

    def stepped(
        self, outputs: list[RequestOutput], duration_s: float, num_tokens: int, stats: EngineStats
    ) -> None:
        self._front._step_done(outputs, duration_s, num_tokens, stats)

    def stats(self, stats: EngineStats) -> None:
        self._front._stats = stats

    def error(self, request_id: str, error: InvalidRequestError) -> None:
        self._front._deliver_error(request_id, error)

    def dropped(self, request_id: str) -> None:
        self._front._deliver_dropped(request_id)

    def died(self, error: BaseException) -> None:
        self._front._dead = error
        self._front._fail_all(EngineDeadError(f"the engine failed: {error}"))


class AsyncEngine(StreamFront):
    """The engine in this process: the step loop on a thread of its own beside the event loop."""

    def __init__(
        self, args: EngineArgs, engine: LLMEngine | None = None, settings: EngineSettings | None = None
    ) -> None:
        super().__init__()
        self.args = args
        self.engine = engine or _build_off_thread(args, settings)
        self.tokenizer: Any = self.engine.tokenizer
        self.served_model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.eos_token_ids = self.engine.eos_token_ids
        self._steps = StepLoop(self.engine, _ThreadSink(self))
        self._thread: threading.Thread | None = None
        self._stats = self.engine.stats()

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._steps.run, name="corral-engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._running = False
        self._steps.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            self._thread = None
        await asyncio.to_thread(self.engine.runner.close)  # tensor-parallel workers, if any
        self._end_all_now(EngineDeadError("the engine is shutting down"))

    def _num_queued(self) -> int:
        return self._steps.num_queued

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (raising InvalidRequestError / QueueFullError / EngineDeadError) and return
        the request's output stream. Leaving the stream early aborts the request."""
        self._check_admission(request_id, self.args.max_waiting)
        request = self.engine.make_request(request_id, prompt, params)
        stream = self._streams.open(request_id, self.abort)
        self._steps.add(request)
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the start of the next step."""
        self._steps.abort(request_id)
