"""A replica's response on its way back to the client: streamed through chunk by chunk (SSE and large
or unsized bodies) or read whole first (small bodies), and the bookkeeping when it ends.

An event stream whose replica dies or stalls before its end (`[DONE]`, or a Responses stream's
terminal event) ends with an SSE error event and `[DONE]` (a Responses stream: with an `error`
event and `response.failed`, as it has no `[DONE]`); a whole body
that breaks off is a 502; any other body that breaks off once started ends the client's connection
without the body's end, so the client sees it cut (never a short 200); a client that hangs up
mid-response closes the upstream request, so the engine aborts it, and so does the end of a
gateway drain's time (a stream then ends with a `draining` error, as above).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from corral_gateway.access import AccessLog, Origin
from corral_gateway.body_reader import BodyReader
from corral_gateway.drain import Drain
from corral_gateway.errors import (
    DRAINING_END,
    UpstreamFailed,
    error_response,
    sse_error_end,
    sse_responses_error_end,
)
from corral_gateway.fleet import Fleet
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.quota import TokenUsage
from corral_gateway.registry import Replica
from corral_gateway.upstream import ReadTimedOut, UpstreamError, UpstreamResponse

logger = logging.getLogger(__name__)

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authenticate",
     "proxy-authorization", "server", "date"}
)  # fmt: skip
_WHOLE_BODY_MAX_BYTES = 4 * 1024 * 1024  # non-streamed bodies up to this size are read whole


class Exchange:
    """One response on its way back to the client; `finish` does the bookkeeping once, however it ends.
    The replica itself is given back by the caller's lease, after the response has been sent."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: GatewayMetrics,
        upstream: UpstreamResponse,
        replica: Replica,
        origin: Origin,
        quota: TokenUsage | None,
        access: AccessLog,
        drain: Drain,
    ) -> None:
        self.fleet, self.metrics, self.upstream, self.replica = fleet, metrics, upstream, replica
        self.origin, self.quota, self.access, self.drain = origin, quota, access, drain
        self.is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        # What the body's bytes told: its usage, and an event stream's: had it ended when it broke?
        self.reader = BodyReader(is_events=self.is_sse)
        self.status_label = str(upstream.status_code)  # of the request counter
        # Why the response ended early, for the access line: "client_gone", "replica_failed" or
        # "draining" (the client got the status sent, then an error event or a cut body).
        self.ended: str | None = None
        self.is_complete = False
        self.is_cut = False  # a body other than an event stream broke off: its end is not sent
        self.is_client_gone = False
        self.is_drained = False  # ended by the end of the gateway's drain time, not the replica
        self.is_finished = False
        self.body_in_hand_s: float | None = None  # time.perf_counter() once a whole body was read

    async def respond(self, disconnect: asyncio.Future[None]) -> Response:
        """SSE and bodies of unknown or large size are streamed through as they arrive; a small
        body of known length (a non-streamed completion) is read whole first and sent in one
        piece, so a body that breaks off can still answer with a clean 502."""
        upstream, origin = self.upstream, self.origin
        self.fleet.observe_headers(self.replica.url, upstream.headers)
        if upstream.status_code < 500:
            self.fleet.record_success(self.replica.url)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["x-request-id"] = origin.request_id
        is_sse, length = self.is_sse, upstream.headers.get("content-length", "")
        if is_sse or not length.isdigit() or int(length) > _WHOLE_BODY_MAX_BYTES:
            disconnect.add_done_callback(self._on_disconnect)
            return PassThrough(
                self._body(is_sse),
                disconnect,
                self.finish,
                lambda: self.is_cut,
                upstream.status_code,
                headers,
            )
        disconnect.cancel()
        content = b""
        try:
            content = await upstream.read()
            self.body_in_hand_s = time.perf_counter()
            self.replica.on_first_byte()
            self.is_complete = True
        except UpstreamError as e:
            self._broken(e, "body")
        finally:
            self.reader.feed(content)
            self.finish()
        if not self.is_complete:
            failed = error_response(UpstreamFailed("The model replica failed while sending the response."))
            failed.headers["x-request-id"] = origin.request_id
            return failed
        self.metrics.ttfb.labels(origin.model).observe(time.monotonic() - origin.start_s)
        return Response(content, status_code=upstream.status_code, headers=headers)

    def delivered(self) -> None:
        """The response has been sent (a stream: to its end): a whole body's relay is timed."""
        if self.body_in_hand_s is not None:
            relay_s = time.perf_counter() - self.body_in_hand_s
            self.metrics.overhead.labels(self.origin.model, "first_byte").observe(relay_s)

    async def _body(self, is_sse: bool) -> AsyncGenerator[bytes, None]:
        """The stream's chunks; each one's relay (in hand to its send to the client returning, which
        is when the response asks for the next) is timed: the first alone, the others' mean. An
        event stream's chunk times also tell when the replica's steps end (`StepPhase`), on the
        fleet's clock, which routing reads: that one reading per chunk times the relay too."""
        is_first = True
        num_later, later_s = 0, 0.0
        clock = self.fleet.clock
        phase = self.replica.step_phase if is_sse else None  # other bodies' chunks are not steps
        try:
            async for chunk in self.upstream.chunks():
                in_hand_s = clock()
                if phase is not None:
                    phase.on_chunk(in_hand_s)
                if is_first:
                    self.replica.on_first_byte()  # its prompt is computed: prefix affinity's ledger
                    self.metrics.ttfb.labels(self.origin.model).observe(
                        time.monotonic() - self.origin.start_s
                    )
                self.reader.feed(chunk)
                yield chunk
                if is_first:
                    relay_s = clock() - in_hand_s
                    self.metrics.overhead.labels(self.origin.model, "first_byte").observe(relay_s)
                    is_first = False
                else:
                    num_later += 1
                    later_s += clock() - in_hand_s
            self.is_complete = True
        except UpstreamError as e:
            if self.is_client_gone:
                return  # our own close of the upstream request, below
            if self.is_drained:  # the same close, at the end of the gateway's drain time
                if is_sse:
                    yield _end_event(self.reader.end(4)) + self._error_end(*DRAINING_END)
                else:
                    self.is_cut = True
                return
            if is_sse and self.reader.has_ended():
                return  # the stream had ended: only the end of its body was lost
            self._broken(e, "stream")
            if is_sse:
                yield _end_event(self.reader.end(4)) + self._error_end(*_why(e))
            else:
                self.is_cut = True
        finally:
            if num_later:
                self.metrics.overhead.labels(self.origin.model, "stream").observe(later_s / num_later)
            self.finish()

    def _error_end(self, message: str, code: str, error_type: str = "upstream_error") -> bytes:
        """The events that end an event stream that could not finish, in its API's way."""
        end = self.reader
        if not end.is_responses:
            return sse_error_end(message, code, error_type)
        response = end.created_response()
        return sse_responses_error_end(message, code, error_type, end.last_sequence_number, response)

    def _on_disconnect(self, disconnect: asyncio.Future[None]) -> None:
        """The client hung up mid-response, or the drain's time ran out: close the upstream
        request, so the engine aborts it (the pending read then fails, which ends the body)."""
        if disconnect.cancelled() or self.is_finished:
            return
        if self.drain.is_over:
            self.is_drained, self.ended = True, "draining"
            self.status_label = "503"  # counted as the drain's 503s: the request was not served
        else:
            self.is_client_gone, self.ended = True, "client_gone"
            self.status_label = "499"
        self.finish()

    def _broken(self, e: UpstreamError, what: str) -> None:
        self.status_label, self.ended = "broken", "replica_failed"
        self.fleet.record_failure(self.replica.url, f"{what}: {e}")
        self.metrics.streams_broken.labels(self.origin.model).inc()
        logger.warning("request %s: replica %s failed mid-response (%s)", self.origin.request_id,
                       self.replica.url, e, extra={"request_id": self.origin.request_id})  # fmt: skip

    def finish(self) -> None:
        if self.is_finished:
            return
        self.is_finished = True
        model = self.origin.model
        self.upstream.close(self.is_complete)
        # A replica that left discovery while this was open has no series any more: not made again.
        replica_label = self.replica.url if self.fleet.is_current(self.replica) else ""
        self.metrics.count_request(model, replica_label, self.status_label)
        self.metrics.duration.labels(model).observe(time.monotonic() - self.origin.start_s)
        reported = self.reader.reported()
        if self.quota is not None:
            if reported is None and self.upstream.status_code >= 400:
                self.quota.refund()  # an error answer serves no tokens
            else:
                self.quota.settle(reported)
        # The access line has the status the client got: a drained stream's was sent already.
        status = str(self.upstream.status_code) if self.is_drained else self.status_label
        self.access.finished(self.origin, self.replica.url, status, reported, self.ended)


def _why(e: UpstreamError) -> tuple[str, str]:
    """The message and code of the error event that ends a broken stream."""
    if isinstance(e, ReadTimedOut):  # nothing came for first_byte_timeout_s
        return "The model replica stopped sending the response.", "upstream_timeout"
    return "The model replica failed while streaming the response.", "upstream_disconnected"


def _end_event(end: bytes) -> bytes:
    """What ends the event a stream was cut off in (`end`: its last bytes), so the error event that
    follows is read on its own rather than as more lines of that event."""
    if not end or end.endswith((b"\n\n", b"\r\n\r\n")):
        return b""
    return b"\n" if end.endswith(b"\n") else b"\n\n"


class PassThrough(StreamingResponse):
    """Sends the body's chunks as they come, and nothing else per chunk.

    Starlette's StreamingResponse starts a task group per response to notice a client leaving
    (under ASGI before 2.4, where sending to a gone client does not fail); the proxy already
    watches for that (`disconnect`, whose callback closes the upstream request and so ends the
    body), so it is not needed here.

    A body cut off (`is_cut`) is left without its end: the server then closes the connection, so
    the client sees a broken response rather than a complete-looking short one."""

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        disconnect: asyncio.Future[None],
        on_end: Callable[[], None],
        is_cut: Callable[[], bool],
        status: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(body, status_code=status, headers=headers)
        self._chunks = body
        self._disconnect = disconnect
        self._on_end = on_end
        self._is_cut = is_cut

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self._is_cut():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._disconnect.cancel()
            await self._chunks.aclose()
            self._on_end()  # when the body never started, its own `finally` did not run
