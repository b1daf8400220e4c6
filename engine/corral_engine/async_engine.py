"""The asyncio front: a step loop on its own thread, per-request output streams, thread-safe abort.

The model's forward pass blocks, so the engine steps on a dedicated thread while the event loop
keeps serving HTTP. Requests and aborts cross to the step thread through queues; outputs come back
through `loop.call_soon_threadsafe`, one callback per step for all requests, or one for several steps
where the loop fell behind them (their outputs merged per request: `StreamFront`). A request's
consumer that falls behind gets the outputs queued meanwhile merged into one.

The engine is built (weights loaded, KV cache allocated) on a thread that then exits, never on
the event loop's: see `_build_off_thread`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from corral_engine.args import EngineArgs
from corral_engine.errors import EngineDeadError, InvalidRequestError
from corral_engine.llm_engine import LLMEngine, Prompt
from corral_engine.lora import LoraRequest
from corral_engine.multimodal import ImageInput, ImagePrompts
from corral_engine.outputs import EngineStats, RequestOutput, StepLatencies
from corral_engine.pooling_params import PoolingParams
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from corral_engine.step_loop import StepLoop
from corral_engine.stream_front import StreamFront

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


class _ThreadSink:
    """The step loop's results, from its thread to the front's event loop."""

    def __init__(self, front: AsyncEngine) -> None:
        self._front = front

    def outputs(self, outputs: list[RequestOutput]) -> None:
        self._front._deliver(outputs)

    def stepped(
        self,
        outputs: list[RequestOutput],
        duration_s: float,
        num_tokens: int,
        latencies: StepLatencies,
        stats: EngineStats,
    ) -> None:
        self._front._step_done(outputs, duration_s, num_tokens, latencies, stats)

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
        super().__init__(args.max_num_seqs)
        self.args = args
        self.engine = engine or _build_off_thread(args, settings)
        self.tokenizer: Any = self.engine.tokenizer
        self.served_model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.eos_token_ids = self.engine.eos_token_ids
        self.embed = self.engine.embed
        # A vision model's image processor (None: text only): the server builds a chat's images.
        self.images: ImagePrompts | None = self.engine.request_builder.images
        self.runner = self.embed.runner  # generate, or pooling (embeddings)
        self.embedding_size = self.embed.embedding_size  # the vectors' length; 0 when generating
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
        """Stop stepping, end every open stream, and close the engine (tensor-parallel workers
        stopped, model freed); idempotent."""
        self._running = False
        self._steps.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            self._thread = None
        await asyncio.to_thread(self.engine.close)
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
        """Validate now (raising InvalidRequestError / QueueFullError / EngineDeadError) and return
        the request's output stream. Leaving the stream early aborts the request. `in_group`: a
        later prompt of one HTTP request whose first was admitted; the waiting-queue limit
        (`max_waiting`) admits or refuses a request's prompts together, so a request with more
        prompts than the limit still gets in once the queue has room. `lora`: the adapter it
        generates with; `mm_inputs`: its images already built (`images.build`), else the prompt's
        `multi_modal_data` are."""
        self._check_admission(request_id, None if in_group else self.args.max_waiting)
        request = self.engine.make_request(request_id, prompt, params, lora=lora, mm_inputs=mm_inputs)
        stream = self._streams.open(request_id, self.abort)
        self._num_handed += 1  # before the step thread can take it
        self._steps.add(request)
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the start of the next step."""
        self._steps.abort(request_id)

    async def add_lora(self, lora: LoraRequest) -> None:
        """Read and register an adapter off the event loop (AdapterError when it cannot be served)."""
        await asyncio.to_thread(self.engine.add_lora, lora)

    def remove_lora(self, lora_id: int) -> None:
        self.engine.remove_lora(lora_id)
