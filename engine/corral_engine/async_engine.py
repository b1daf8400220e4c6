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
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from corral_engine.args import EngineArgs
from corral_engine.core.sequence import Request
from corral_engine.errors import EngineDeadError, InvalidRequestError
from corral_engine.llm_engine import LLMEngine, Prompt
from corral_engine.outputs import EngineStats, RequestOutput
from corral_engine.request_streams import RequestStreams
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


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


class AsyncEngine:
    def __init__(
        self, args: EngineArgs, engine: LLMEngine | None = None, settings: EngineSettings | None = None
    ) -> None:
        self.args = args
        self.engine = engine or _build_off_thread(args, settings)
        self.tokenizer: Any = self.engine.tokenizer
        self.served_model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.eos_token_ids = self.engine.eos_token_ids
        self._adds: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._wakeup = threading.Event()
        self._streams = RequestStreams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        self._dead: BaseException | None = None
        self._stats = self.engine.stats()
        # Called on the step thread after every step with (duration_s, num_batched_tokens);
        # must be thread-safe and quick (a Prometheus histogram observe is).
        self.on_step: Callable[[float, int], None] | None = None

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="corral-engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._running = False
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            self._thread = None
        await asyncio.to_thread(self.engine.runner.close)  # tensor-parallel workers, if any
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError("the engine is shutting down"))

    async def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._streams and not self._adds:
                return True
            await asyncio.sleep(0.05)
        return not self._streams

    @property
    def is_running(self) -> bool:
        return self._running and self._dead is None

    # -- requests -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The state after the last step, as vLLM reports it: `num_waiting` counts requests the
        scheduler could not start, not ones that arrived since and start at the next step (a
        router reading that burst as a queue would hold requests the engine has room for)."""
        return self._stats

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (raising InvalidRequestError / QueueFullError / EngineDeadError) and return
        the request's output stream. Leaving the stream early aborts the request."""
        if self._dead is not None or not self._running:
            raise EngineDeadError("the engine is not running")
        self._streams.check_new(request_id, self.args.max_waiting, self._stats.num_waiting + len(self._adds))
        request = self.engine.make_request(request_id, prompt, params)
        stream = self._streams.open(request_id, self.abort)
        self._adds.append(request)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the start of the next step."""
        self._aborts.append(request_id)
        self._wakeup.set()

    # -- the step thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while self._running:
                self._drain_inputs()
                if not engine.has_unfinished_requests():
                    self._stats = engine.stats()
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                started = time.perf_counter()
                outputs = engine.step()
                if self.on_step is not None:
                    self.on_step(time.perf_counter() - started, engine.last_step_num_tokens)
                self._stats = engine.stats()
                if outputs:
                    self._deliver(outputs)
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
        except BaseException as e:  # the step loop must report, not vanish
            logger.exception("engine step loop died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine failed: {e}"))
        finally:
            self._stats = engine.stats()

    def _drain_inputs(self) -> None:
        """Apply queued aborts and admissions."""
        engine = self.engine
        while self._aborts:
            request_id = self._aborts.popleft()
            if any(r.request_id == request_id for r in self._adds):
                self._adds = deque(r for r in self._adds if r.request_id != request_id)
            output = engine.abort_request(request_id)
            if output is not None:
                self._deliver([output])
            elif self._loop is not None:
                self._loop.call_soon_threadsafe(self._streams.pop, request_id, None)
        while self._adds:
            request = self._adds.popleft()
            try:
                engine.insert_request(request)
            except InvalidRequestError as e:
                self._deliver_error(request.request_id, e)

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

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        for request_id in list(self._streams):
            self._deliver_error(request_id, error)
