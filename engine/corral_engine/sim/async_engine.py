"""The simulated engine's asyncio front: the server's `EngineClient` with a step loop that is a task
on the event loop, not a thread, so one process can host dozens of replicas.

Each step sleeps until the time the profile predicts for its batch. The loop keeps its own
timeline: a step starts when the previous one was predicted to end (or now, after idling), so a
wake-up the event loop delivers late, and the host's own work on a step's outputs, shorten the
next sleep instead of slowing the replica down for good. A replica at most _MAX_CATCH_UP_S behind
catches up; beyond that (a stalled or overloaded host) the rest is lost, so a long stall is not
followed by a burst of steps with no sleep at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from corral_engine.core.sequence import Request
from corral_engine.errors import EngineDeadError, InvalidRequestError
from corral_engine.lora import LoraRequest, read_adapter_config
from corral_engine.multimodal import ImageInput
from corral_engine.outputs import EngineStats, RequestOutput
from corral_engine.pooling_params import PoolingParams
from corral_engine.sampling_params import SamplingParams
from corral_engine.sim.engine import Prompt, SimEngine
from corral_engine.stream_front import StreamFront

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_MAX_CATCH_UP_S = 0.05


class AsyncSimEngine(StreamFront):
    """The streams, admission checks and running state are `StreamFront`'s, as the real engine's
    fronts have them; only the step loop differs (a task on this loop, outputs put directly)."""

    def __init__(self, engine: SimEngine, max_waiting: int | None = None, max_lora_rank: int = 16) -> None:
        """`engine` must use the running loop's clock (`loop.time`), which `build` arranges."""
        super().__init__(engine.scheduler.config.max_num_seqs)
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer
        self.served_model_name = engine.served_model_name
        self.max_model_len = engine.max_model_len
        self.runner = engine.runner  # the server's `EmbeddingEngine`: generate, or pooling
        self.embedding_size = engine.embedding_size
        self.embed = engine.embed  # what the server reads of a pooling model: tasks, labels
        self.images = engine.images  # a vision model's image processor (None: text only), as the engine's
        self.max_waiting = max_waiting
        self.max_lora_rank = max_lora_rank
        self._adds: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._num_taken = 0  # requests taken from `_adds`: `StreamFront.num_waiting_now`
        self._stats = engine.stats()
        self.timeline_s = 0.0  # when the last step ended, on the loop's clock
        self.max_lag_s = 0.0  # the latest a step was committed after its predicted end (host resets)

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._running = True
            self._task = asyncio.create_task(self._run(), name=f"sim-{self.served_model_name}")

    async def shutdown(self) -> None:
        self._running = False
        self._wakeup.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.end_open_streams(EngineDeadError("the engine is shutting down"))

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        *,
        in_group: bool = False,
        lora: LoraRequest | None = None,
        mm_inputs: tuple[ImageInput, ...] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As the engine's: `mm_inputs`, a chat's images built by `images`."""
        self._check_admission(request_id, None if in_group else self.max_waiting)
        request = self.engine.make_request(request_id, prompt, params, lora=lora, mm_inputs=mm_inputs)
        stream = self._streams.open(request_id, self.abort)
        self._num_handed += 1
        self._adds.append(request)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wakeup.set()

    async def add_lora(self, lora: LoraRequest) -> None:
        """Check the adapter's config, as the engine does (no weights here; AdapterError)."""
        read_adapter_config(lora.name, lora.path, self.max_lora_rank)

    def remove_lora(self, lora_id: int) -> None:
        """Nothing held: a simulated adapter is only its name on requests."""

    # -- the step loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        engine = self.engine
        loop = asyncio.get_running_loop()
        is_busy = False  # the previous iteration ran a step: this one starts where it was due to end
        try:
            while self._running:
                self._drain_inputs()
                step = engine.begin_step() if engine.has_unfinished_requests() else None
                if step is None:
                    is_busy = False
                    self._stats = self._engine_stats()
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), _IDLE_WAIT_S)
                    continue
                now = loop.time()
                start = max(self.timeline_s, now - _MAX_CATCH_UP_S) if is_busy else max(self.timeline_s, now)
                self.timeline_s = start + step.duration_s
                is_busy = True
                await asyncio.sleep(max(0.0, self.timeline_s - loop.time()))
                self.max_lag_s = max(self.max_lag_s, loop.time() - self.timeline_s)
                outputs = engine.finish_step(step)
                if self.on_step is not None:
                    self.on_step(step.duration_s, step.shape.num_tokens, engine.last_step_latencies)
                self._stats = self._engine_stats()
                self._put_outputs(outputs)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the step loop must report, not vanish
            logger.exception("simulated engine step loop died")
            self._dead = e
            self.end_open_streams(EngineDeadError(f"the engine failed: {e}"))

    def _engine_stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.num_requests_taken_total = self._num_taken
        return stats

    def _drain_inputs(self) -> None:
        engine = self.engine
        while self._aborts:
            request_id = self._aborts.popleft()
            num_queued = len(self._adds)
            self._adds = deque(r for r in self._adds if r.request_id != request_id)
            self._num_taken += num_queued - len(self._adds)
            output = engine.abort_request(request_id)
            if output is not None:
                self._put_outputs([output])
            else:
                self._streams.drop(request_id)
        while self._adds:
            request = self._adds.popleft()
            self._num_taken += 1
            try:
                engine.insert_request(request)
            except InvalidRequestError as e:
                queue = self._streams.get(request.request_id)
                if queue is not None:
                    queue.put_nowait(e)
