"""One output queue per request for the engine's asyncio fronts (the threaded AsyncEngine and the
simulator's AsyncSimEngine): admission checks, a stream that merges outputs that piled up, and an
abort when the consumer leaves early; or, for a consumer that asks, a listener called with each
output as it is delivered (no queue, no task woken per output). Light: asyncio only, no torch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from corral_engine.errors import InvalidRequestError, QueueFullError, RequestAbortedError
from corral_engine.outputs import RequestOutput, merge_outputs

Queue = asyncio.Queue[RequestOutput | BaseException]
Listener = Callable[[RequestOutput | BaseException], None]


class _Listening:
    """Where a listened-to request's outputs go: straight to its listener (what a queue's
    `put_nowait` would be given)."""

    __slots__ = ("put_nowait",)

    def __init__(self, listener: Listener) -> None:
        self.put_nowait = listener


class RequestStreams(dict[str, "Queue | _Listening"]):
    """request id -> its output queue (or listener); the step loop puts outputs (or an exception)
    in, the request's consumer reads them through `stream`, or is called with them (`listen`)."""

    def check_new(self, request_id: str, max_waiting: int | None, num_waiting_if_admitted: int) -> None:
        """Refuse a duplicate id (400), or a request that would take the waiting queue past
        `max_waiting` (429 with Retry-After)."""
        if request_id in self:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if max_waiting is not None and num_waiting_if_admitted > max_waiting:
            raise QueueFullError(
                f"the engine's waiting queue is full ({max_waiting} requests)",
                1.0,
                num_waiting_if_admitted - 1,
            )

    def open(self, request_id: str, abort: Callable[[str], None]) -> AsyncIterator[RequestOutput]:
        """Register the request's queue and return its stream; leaving the stream before the
        final output calls `abort(request_id)`."""
        queue: Queue = asyncio.Queue()
        self[request_id] = queue
        return self._stream(request_id, queue, abort)

    def listen(self, request_id: str, listener: Listener) -> bool:
        """Call `listener` with each of the request's outputs (and an exception that ends it) as it
        is put, on the event loop, instead of queueing it for the stream; what is queued already
        goes to the listener first. The stream must not have been iterated, nor be afterwards.
        False where the request has no queue (finished already, or unknown): read the stream.
        The listener must not raise; leaving early is the consumer's to abort, as the stream
        would have."""
        queue = self.get(request_id)
        if not isinstance(queue, asyncio.Queue):
            return False
        while not queue.empty():
            listener(queue.get_nowait())
        self[request_id] = _Listening(listener)
        return True

    def drop(self, request_id: str) -> None:
        """The request was aborted before the engine took it, so no final output comes: a
        consumer still waiting (a non-streamed request reading its aborted outputs) is ended."""
        queue = self.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(RequestAbortedError(f"request {request_id!r} was aborted before it started"))

    async def _stream(
        self, request_id: str, queue: Queue, abort: Callable[[str], None]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Outputs that piled up while this consumer was behind go out as one.
                error: BaseException | None = None
                while not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    item = merge_outputs(item, later)
                finished = item.finished
                yield item
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            self.pop(request_id, None)
            if not finished:
                abort(request_id)
