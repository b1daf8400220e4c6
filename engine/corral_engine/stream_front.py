"""The event loop's side of a step loop, shared by the engine's fronts: `AsyncEngine` (the loop on
a thread of this process), `EngineCoreClient` (the loop in a process of its own) and the
simulator's `AsyncSimEngine` (the loop a task on the event loop).

Imports no torch (import-linter holds it to that), so neither the simulator nor the server's side
of the engine-core process needs it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from typing import Self

from corral_engine.errors import EngineDeadError
from corral_engine.outputs import EngineStats, RequestOutput, StepLatencies, merge_outputs
from corral_engine.request_streams import Listener, RequestStreams

# What the receiving thread hands the event loop: a step's outputs, or a call to make there.
_Posted = list[RequestOutput] | Callable[[], object]


class StreamFront:
    """The event loop's side of a step loop, whichever thread or process runs it: one output queue
    (or listener) per request, filled on the event loop from what the thread that receives the
    steps' results posts: one wake-up (`loop.call_soon_threadsafe`) per step for all requests
    while the loop keeps up, and one for all the steps posted meanwhile when it falls behind, each
    request's outputs from those merged into one (as vLLM's output collector does): a busy loop
    then writes one event of several tokens to each stream instead of catching up a token at a
    time."""

    def __init__(self, max_num_seqs: int = 0) -> None:
        self._streams = RequestStreams()
        self._max_num_seqs = max_num_seqs  # the running batch's seats (0: admission counts none free)
        # Requests handed to the step loop, ever; the loop's stats say how many of them it has taken
        # (`EngineStats.num_requests_taken_total`): the rest are in no stats yet.
        self._num_handed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = EngineStats()
        self._running = False  # between start and shutdown
        self._dead: BaseException | None = None  # why the step loop stopped on its own
        # Called after every step with (duration_s, num_batched_tokens, the token latencies it
        # added), on the thread that receives the step; must be thread-safe and quick (Prometheus
        # histogram observes are).
        self.on_step: Callable[[float, int, StepLatencies], None] | None = None
        self._posted: list[_Posted] = []  # from the receiving thread, for the event loop
        self._posted_lock = threading.Lock()

    # -- life cycle: `async with engine:` starts it and shuts it down ---------------------------
    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Stop stepping and end every open stream; idempotent."""
        raise NotImplementedError

    async def close(self) -> None:
        """`shutdown()`, by the name `LLMEngine.close` has."""
        await self.shutdown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def stats(self) -> EngineStats:
        """The state after the last step, as vLLM reports it: `num_waiting` counts requests the
        scheduler could not start, not ones that arrived since and start at the next step (a
        router reading that burst as a queue would hold requests the engine has room for)."""
        return self._stats

    def _num_unseen(self) -> int:
        """Requests handed to the step loop that its last stats do not count yet: queued for it,
        taken in since that step (in the scheduler, not yet stepped), or on the pipe to its
        process."""
        return max(0, self._num_handed - self._stats.num_requests_taken_total)

    def num_waiting_now(self, num_new: int = 0) -> int:
        """Requests the engine holds (with `num_new` more) that will not run at its next step, as
        far as this side knows: the scheduler's waiting queue at the last step, plus those it has
        not seen since beyond the running batch's free seats (`max_num_seqs` less the running; none
        while requests wait already, as they go first). `--max-waiting` bounds this, so a burst
        into an idle engine gets `max_num_seqs + max_waiting` admitted, however the steps fall
        between its requests. The scheduler may still hold one of them back (no KV blocks, the
        step's token budget spent), so its own waiting count can briefly read more."""
        stats = self._stats  # one read: the step loop's thread replaces it whole
        unseen = max(0, self._num_handed - stats.num_requests_taken_total) + num_new
        free = 0 if stats.num_waiting else max(0, self._max_num_seqs - stats.num_running)
        return stats.num_waiting + max(0, unseen - free)

    @property
    def is_running(self) -> bool:
        return self._running and self._dead is None

    def _check_admission(self, request_id: str, max_waiting: int | None) -> None:
        """EngineDeadError when nothing steps; a duplicate id or a full waiting queue refused."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        self._streams.check_new(request_id, max_waiting, self.num_waiting_now(num_new=1))

    def listen(self, request_id: str, listener: Listener) -> bool:
        """On the event loop: call `listener` with the request's outputs as each step delivers
        them, instead of queueing them for its stream (`RequestStreams.listen`); False where the
        request has no queue any more (read its stream then)."""
        return self._streams.listen(request_id, listener)

    async def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._streams and not self._num_unseen():
                return True
            await asyncio.sleep(0.05)
        return not self._streams

    # -- from the receiving thread --------------------------------------------------------------
    def _post(self, item: _Posted) -> None:
        """Hand `item` to the event loop, after what was posted before it; the loop is woken only
        where nothing posted is waiting for it already (`_take_posted` takes it all)."""
        assert self._loop is not None
        with self._posted_lock:
            self._posted.append(item)
            if len(self._posted) > 1:
                return
        try:
            self._loop.call_soon_threadsafe(self._take_posted)
        except RuntimeError:  # the loop is closed: nothing will take the list, nor wake a later loop
            with self._posted_lock:
                self._posted.clear()
            raise

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._post(outputs)

    def _take_posted(self) -> None:
        """On the event loop: everything posted since the last call, in order; the outputs of
        steps posted back to back go out merged, one output per request."""
        with self._posted_lock:
            posted, self._posted = self._posted, []
        if len(posted) == 1 and isinstance(posted[0], list):  # the loop kept up with the steps
            self._put_outputs(posted[0])
            return
        pending: dict[str, RequestOutput] = {}
        for item in posted:
            if isinstance(item, list):
                # No output follows a finished one: its id stays taken until that is put here.
                for output in item:
                    earlier = pending.get(output.request_id)
                    pending[output.request_id] = output if earlier is None else merge_outputs(earlier, output)
                continue
            if pending:
                self._put_outputs(list(pending.values()))
                pending = {}
            item()
        if pending:
            self._put_outputs(list(pending.values()))

    def _put_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finished:  # the stream keeps its queue; the table must not
                    del self._streams[output.request_id]

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        self._post(functools.partial(self._put_error, request_id, error))

    def _put_error(self, request_id: str, error: BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _deliver_dropped(self, request_id: str) -> None:
        if self._loop is not None:
            self._post(functools.partial(self._streams.drop, request_id))

    def _step_done(
        self,
        outputs: list[RequestOutput],
        duration_s: float,
        num_tokens: int,
        latencies: StepLatencies,
        stats: EngineStats,
    ) -> None:
        if self.on_step is not None:
            self.on_step(duration_s, num_tokens, latencies)
        self._stats = stats
        if outputs:
            self._deliver(outputs)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        for request_id in list(self._streams):
            self._deliver_error(request_id, error)

    def end_open_streams(self, error: BaseException) -> None:
        """On the event loop, at shutdown or when a drain's grace period ends: every stream still
        open ends with `error` (the server writes it as an error event, then `[DONE]`)."""
        for queue in self._streams.values():
            queue.put_nowait(error)
