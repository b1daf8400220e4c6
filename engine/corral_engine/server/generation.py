"""One HTTP request's life on the engine: submit its prompts, merge their outputs, abort on exit.

Whatever ends the HTTP request (finish, client hang-up, error, cancellation), `close()` aborts the
engine requests that have not finished, so their KV blocks are freed within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from corral_engine.errors import InvalidRequestError
from corral_engine.lora import LoraRequest
from corral_engine.multimodal import ImageInput
from corral_engine.outputs import RequestOutput, TokenLogprob
from corral_engine.pooling_params import PoolingParams
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import access
from corral_engine.server.engine_client import EmbeddingEngine, EngineClient, ListeningEngine
from corral_engine.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# How long a non-streamed request whose client left waits for its aborted engine requests' final
# outputs: the engine applies an abort before its next step, so a step's time is enough.
ABORT_OUTPUT_WAIT_S = 5.0


@dataclass(slots=True)
class InFlight:
    """How many HTTP generation requests are open (drain waits for zero)."""

    count: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        self.count += 1
        self.idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


@dataclass(slots=True)
class Collected:
    finals: list[RequestOutput]  # the last output of each prompt, in prompt order
    logprobs: dict[tuple[int, int], list[TokenLogprob]]  # (prompt index, output index) -> all tokens'

    def logprobs_of(self, prompt_index: int, output_index: int) -> list[TokenLogprob]:
        return self.logprobs.get((prompt_index, output_index), [])


class GenerationRun:
    """The engine requests of one HTTP request: one per prompt, each with params.n sequences (an
    embeddings request's: one per input, with PoolingParams; a score request's: one per pair, each
    with its own PoolingParams, its token types)."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        in_flight: InFlight,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams | PoolingParams | list[PoolingParams],
        lora: LoraRequest | None = None,
        mm_inputs: tuple[ImageInput, ...] = (),
    ) -> None:
        """`mm_inputs`: the images of a single prompt (a chat's), built by the engine's processor."""
        self.engine = engine
        # The adapter and images go to the engine only when there are some: test engines need not
        # take them.
        self._extra: dict[str, Any] = {} if lora is None else {"lora": lora}
        if mm_inputs:
            self._extra["mm_inputs"] = mm_inputs
        self.metrics = metrics
        self.request_id = request_id
        self.params = params
        self.num_prompts = len(prompts)
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self._in_flight = in_flight
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._ids: list[str] = []
        self._unfinished: set[str] = set()
        # Each prompt's latest output and the tokens its outputs brought (a streamed output
        # carries only its new ones): what a request ended early is counted with.
        self._last: list[RequestOutput | None] = [None] * len(prompts)
        self._num_tokens_seen = [0] * len(prompts)
        self._closed = False
        in_flight.enter()
        try:
            for i, prompt in enumerate(prompts):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt_params = params[i] if isinstance(params, list) else params
                self._add(engine_id, prompt, prompt_params, in_group=i > 0)
        except BaseException:
            self.abort_unfinished()
            self._closed = True
            in_flight.leave()
            raise

    def _add(
        self, engine_id: str, prompt: list[int], params: SamplingParams | PoolingParams, in_group: bool
    ) -> None:
        # PoolingParams reach only an engine that takes them (the embeddings route checks its runner).
        add_request = cast(EmbeddingEngine, self.engine).add_request
        try:
            stream = add_request(engine_id, prompt, params, in_group=in_group, **self._extra)
        except InvalidRequestError as e:
            if e.param != "request_id":
                raise
            # A client reused an x-request-id that is still running here: the response keeps the
            # id it asked for; only the engine's own key gets a suffix.
            engine_id = f"{engine_id}-{uuid.uuid4().hex[:8]}"
            stream = add_request(engine_id, prompt, params, in_group=in_group, **self._extra)
        self._streams.append(stream)
        self._ids.append(engine_id)
        self._unfinished.add(engine_id)

    def abort_unfinished(self) -> None:
        """Abort the engine requests that have not finished; idempotent, never blocks."""
        request_id = access.current_id()
        for engine_id in sorted(self._unfinished):
            logger.info("aborting request %s", engine_id, extra={"request_id": request_id})
            self.engine.abort(engine_id)
        self._unfinished.clear()

    async def close(self) -> None:
        """Abort what has not finished and close the engine's streams; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._count_unfinished()
        self.abort_unfinished()
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                # Nothing iterates the streams any more (the consumers were cancelled first).
                with contextlib.suppress(RuntimeError):
                    await aclose()
        self._in_flight.leave()

    def _count_unfinished(self) -> None:
        """The access line's (and span's) tokens of the engine requests ending early (the client
        left, the drain's time ran out, an error): what each had computed by its latest output.
        A stream's abort comes as its streams are closed, so its final output is never read; a
        non-streamed request has no output before its end, so it reads that one instead
        (`collect_unless_disconnected`)."""
        for index, engine_id in enumerate(self._ids):
            last = self._last[index]
            if last is not None and engine_id in self._unfinished:
                access.count_tokens(last, self._num_tokens_seen[index])

    def _account(self, index: int, out: RequestOutput) -> None:
        """Metrics and bookkeeping for each output of prompt `index`, however it arrives."""
        self._last[index] = out
        for o in out.outputs:
            self._num_tokens_seen[index] += len(o.delta_token_ids)
        if out.finished:
            self._unfinished.discard(self._ids[index])
            params = self.params if isinstance(self.params, SamplingParams) else None
            self.metrics.observe_finished(out, params)
            access.count_tokens(out)

    async def _follow(self, index: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for out in self._streams[index]:
            self._account(index, out)
            yield index, out
        # The stream may end without a finished output (e.g. after an abort).
        self._unfinished.discard(self._ids[index])

    def listen(
        self,
        on_output: Callable[[int, RequestOutput], None],
        on_end: Callable[[BaseException | None], None],
    ) -> bool:
        """Instead of `outputs()`: on the event loop, `on_output(0, output)` for each output of a
        one-prompt run as its step delivers it, then `on_end(None)` after the final one, or
        `on_end(error)` where the engine ends it with an error. Neither is called once the run is
        closed, and `on_output` must not raise (it runs inside the step's delivery to every
        request). False where the engine cannot call back (or the run has several prompts, or the
        request finished already): iterate `outputs()` then. Saves a queue, a task wake-up and
        three async generators per output: ~5 of the event loop's ~30 µs a streamed token."""
        if self.num_prompts != 1 or not hasattr(self.engine, "listen"):
            return False

        def deliver(item: RequestOutput | BaseException) -> None:
            if self._closed:
                return
            if isinstance(item, BaseException):
                on_end(item)
                return
            try:
                self._account(0, item)
            except Exception as e:  # not into the step's delivery to every other request
                on_end(e)
                return
            on_output(0, item)
            if item.finished:
                on_end(None)

        # The engine calls back from its step's delivery, outside this request's context: run in
        # it, so the access record (and the request's span) get the tokens as when reading.
        context = contextvars.copy_context()

        def listener(item: RequestOutput | BaseException) -> None:
            context.run(deliver, item)

        return cast(ListeningEngine, self.engine).listen(self._ids[0], listener)

    def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs as they arrive, across all prompts (one prompt, the usual
        case, is its own stream: no merging layer per token)."""
        return self._follow(0) if self.num_prompts == 1 else self._merged()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for item in self._follow(index):
                    queue.put_nowait(item)
            except Exception as e:  # handed to the consumer, which re-raises it
                queue.put_nowait(e)
            queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(self.num_prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def collect(self) -> Collected:
        """The last output of every prompt (full text and token ids) and the logprobs seen on the
        way: through the engine's listener where it offers one (no queue, task wake-up or async
        generator per output, as a stream's response does), else by reading the streams."""
        last: list[RequestOutput | None] = [None] * self.num_prompts
        logprobs: dict[tuple[int, int], list[TokenLogprob]] = {}

        def keep(index: int, out: RequestOutput) -> None:
            last[index] = out
            for o in out.outputs:
                if o.delta_logprobs:
                    logprobs.setdefault((index, o.index), []).extend(o.delta_logprobs)

        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def end(error: BaseException | None) -> None:
            if ended.done():  # the collector was cancelled (the client left) before this
                return
            if error is None:
                ended.set_result(None)
            else:
                ended.set_exception(error)

        if self.listen(keep, end):
            await ended
        else:
            async for index, out in self.outputs():
                keep(index, out)
        return Collected([out for out in last if out is not None], logprobs)


async def wait_for_disconnect(receive: object) -> None:
    """Return once the ASGI server reports that the client went away."""
    while True:
        message = await receive()  # type: ignore[operator]
        if message["type"] == "http.disconnect":
            return


async def collect_unless_disconnected(run: GenerationRun, receive: object) -> Collected | None:
    """Collect a non-streaming result; None (and the run aborted) if the client hangs up first.
    A non-streamed request has no output before its last: after the abort, the collector reads
    the aborted requests' final outputs (for `ABORT_OUTPUT_WAIT_S` at most), so the access line
    and span count the tokens they had made."""
    collector = asyncio.create_task(run.collect())
    watcher = asyncio.create_task(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector in done:
            return collector.result()
        logger.info("client disconnected from %s", run.request_id)
        run.abort_unfinished()
        # The engine's error (RequestAbortedError: it had not taken the request), or no output in time.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(collector), ABORT_OUTPUT_WAIT_S)
        return None
    finally:
        for task in (collector, watcher):
            task.cancel()
        for task in (collector, watcher):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await run.close()
