"""Forward one OpenAI request to a replica and stream its answer back byte for byte.

Retries on another replica only before the first response byte (connect error, 5xx, engine queue
full); a stream whose replica dies ends with an SSE error event; a client that hangs up closes
the upstream request, so the engine aborts it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from corral_gateway.auth import ApiKey, KeyStore
from corral_gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    Unavailable,
    UpstreamFailed,
    UpstreamTimeout,
    error_response,
    sse_error_event,
)
from corral_gateway.fleet import Fleet
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.peek import RequestInfo, peek_request
from corral_gateway.registry import Replica
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import (
    ConnectFailed,
    ConnectTimedOut,
    Dropped,
    ReadTimedOut,
    Upstream,
    UpstreamError,
    UpstreamResponse,
)

logger = logging.getLogger(__name__)

PRIORITY_HEADER = "x-corral-priority"
MAX_ABS_PRIORITY = 1000
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authenticate",
     "proxy-authorization", "server", "date"}
)  # fmt: skip
_TAIL_BYTES = 4096  # enough for the usage object at the end of a response
_WHOLE_BODY_MAX_BYTES = 4 * 1024 * 1024  # non-streamed bodies up to this size are read whole
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
T = TypeVar("T")
# Request ids: a random prefix per process and a counter (uuid4 per request reads os.urandom).
_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def _new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class ClientGone(Exception):
    """The client disconnected before the response started."""


@dataclass(frozen=True, slots=True)
class ProxyDeps:
    settings: GatewaySettings
    fleet: Fleet
    upstream: Upstream
    metrics: GatewayMetrics
    keys: Callable[[], KeyStore | None]


async def proxy(deps: ProxyDeps, request: Request, path: str) -> Response:
    start_s = time.monotonic()
    request_id = request.headers.get("x-request-id") or _new_request_id()
    model = "unknown"
    try:
        raw = await _read_body(request, deps.settings.max_request_bytes)
        info = peek_request(raw, deps.settings.affinity_block_chars, deps.settings.affinity_num_blocks)
        keystore = deps.keys()
        api_key = keystore.authenticate(request.headers) if keystore is not None else None
        model = _route_model(deps.fleet, info.model)
        priority = _priority(request.headers.get(PRIORITY_HEADER))
        if keystore is not None and api_key is not None:
            keystore.admit(api_key, info.estimated_tokens, time.monotonic())
        headers = _upstream_headers(request, request_id, deps.settings, keystore is not None)
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            upstream, replica = await _dispatch(
                deps, model, info, priority, api_key, raw, headers, path, disconnect
            )
        except BaseException:
            disconnect.cancel()
            raise
    except ClientGone:
        deps.metrics.requests.labels(model, "", "499").inc()
        return Response(status_code=499)
    except GatewayError as e:
        deps.metrics.requests.labels(model, "", str(e.status_code)).inc()
        deps.metrics.rejected.labels(model, e.code or e.error_type).inc()
        return _with_request_id(error_response(e), request_id)
    exchange = _Exchange(deps, upstream, replica, model, info, api_key, request_id, start_s)
    return await exchange.respond(disconnect)


async def _dispatch(
    deps: ProxyDeps,
    model: str,
    info: RequestInfo,
    priority: int,
    api_key: ApiKey | None,
    raw: bytes,
    headers: dict[str, str],
    path: str,
    disconnect: asyncio.Future[None],
) -> tuple[UpstreamResponse, Replica]:
    """Admit, send, and retry on another replica until a response starts (or attempts run out)."""
    fleet, metrics = deps.fleet, deps.metrics
    fairness_key = api_key.key_id if api_key is not None else ""
    tried: list[str] = []
    wake_timeout_s = fleet.wake_timeout_s(model)
    for attempt in range(deps.settings.max_attempts):
        queued_s = time.monotonic()
        replica = fleet.admission.try_acquire(model, info.prefix_hash, tried)
        if replica is None:
            acquire = fleet.admission.acquire(
                model, info.prefix_hash, priority, fairness_key, tried, wake_timeout_s
            )
            replica = await _race(acquire, disconnect, on_late=fleet.admission.release)
        metrics.queue_wait.labels(model).observe(time.monotonic() - queued_s)
        can_retry = attempt + 1 < deps.settings.max_attempts
        outcome = await _send_once(deps, replica, raw, headers, path, disconnect, tried, can_retry)
        if isinstance(outcome, str):  # a retry reason; the replica was released
            tried.append(replica.url)
            metrics.retries.labels(model, outcome).inc()
            logger.warning("request %s: replica %s failed (%s); attempt %d", headers["x-request-id"],
                           replica.url, outcome, attempt + 1)  # fmt: skip
            continue
        return outcome, replica
    raise UpstreamFailed("No replica of the model could serve the request.")


async def _send_once(
    deps: ProxyDeps,
    replica: Replica,
    raw: bytes,
    headers: dict[str, str],
    path: str,
    disconnect: asyncio.Future[None],
    tried: list[str],
    can_retry: bool,
) -> UpstreamResponse | str:
    """The replica's response (to pass through), or why to retry elsewhere (replica released)."""
    fleet = deps.fleet
    try:
        upstream = await _race(
            deps.upstream.post(replica.url + path, raw, headers), disconnect, on_late=_close_unread
        )
    except (ClientGone, asyncio.CancelledError):
        fleet.admission.release(replica)
        raise
    except ReadTimedOut as e:
        fleet.admission.release(replica)
        fleet.record_failure(replica.url, str(e))
        raise UpstreamTimeout("The model replica did not answer in time.") from e
    except (ConnectFailed, ConnectTimedOut) as e:
        fleet.admission.release(replica)
        fleet.record_failure(replica.url, str(e))
        return "connect_timeout" if isinstance(e, ConnectTimedOut) else "connect_error"
    except Dropped:
        # Dropped before any response: a dying replica, or a keep-alive connection the replica
        # closed just as it was reused. Safe to retry; only connect errors and 5xx count
        # towards ejection, so a race cannot eject a healthy replica.
        fleet.admission.release(replica)
        return "transport_error"
    status = upstream.status_code
    is_retryable = status >= 500 or status == 429  # 429: that engine's own queue is full
    if is_retryable and can_retry and fleet.router.candidates(replica.model, [*tried, replica.url]):
        upstream.close(complete=False)
        fleet.admission.release(replica)
        if status >= 500:
            fleet.record_failure(replica.url, f"HTTP {status}")
        return f"http_{status}"
    return upstream


class _Exchange:
    """One response on its way back to the client, and the bookkeeping when it ends."""

    def __init__(
        self,
        deps: ProxyDeps,
        upstream: UpstreamResponse,
        replica: Replica,
        model: str,
        info: RequestInfo,
        api_key: ApiKey | None,
        request_id: str,
        start_s: float,
    ) -> None:
        self.deps, self.upstream, self.replica, self.model = deps, upstream, replica, model
        self.info, self.api_key, self.request_id, self.start_s = info, api_key, request_id, start_s
        keystore = deps.keys()
        self.keystore = keystore if api_key is not None and api_key.limits.tokens_per_minute else None
        self.tail = bytearray()  # the body's last bytes, for the usage of token-limited keys
        self.status_label = str(upstream.status_code)
        self.is_complete = False
        self.is_client_gone = False
        self.is_finished = False

    async def respond(self, disconnect: asyncio.Future[None]) -> Response:
        """SSE and bodies of unknown or large size are streamed through as they arrive; a small
        body of known length (a non-streamed completion) is read whole first and sent in one
        piece, so a body that breaks off can still answer with a clean 502."""
        fleet, upstream = self.deps.fleet, self.upstream
        fleet.observe_headers(self.replica.url, upstream.headers)
        if upstream.status_code < 500:
            fleet.record_success(self.replica.url)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["x-request-id"] = self.request_id
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        length = upstream.headers.get("content-length", "")
        if is_sse or not length.isdigit() or int(length) > _WHOLE_BODY_MAX_BYTES:
            disconnect.add_done_callback(self._on_disconnect)
            return _PassThrough(self._body(is_sse), disconnect, self.finish, upstream.status_code, headers)
        disconnect.cancel()
        content = b""
        try:
            content = await upstream.read()
            self.is_complete = True
        except UpstreamError as e:
            self._broken(e, "body")
        finally:
            self.tail.extend(content[-_TAIL_BYTES:])
            self.finish()
        if not self.is_complete:
            failed = UpstreamFailed("The model replica failed while sending the response.")
            return _with_request_id(error_response(failed), self.request_id)
        self.deps.metrics.ttfb.labels(self.model).observe(time.monotonic() - self.start_s)
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def _body(self, is_sse: bool) -> AsyncGenerator[bytes, None]:
        is_first = True
        try:
            async for chunk in self.upstream.chunks():
                if is_first:
                    self.deps.metrics.ttfb.labels(self.model).observe(time.monotonic() - self.start_s)
                    is_first = False
                if self.keystore is not None:
                    self.tail.extend(chunk)
                    del self.tail[:-_TAIL_BYTES]
                yield chunk
            self.is_complete = True
        except UpstreamError as e:
            if self.is_client_gone:
                return  # our own close of the upstream request, below
            self._broken(e, "stream")
            if is_sse:
                yield sse_error_event("The model replica failed while streaming the response.")
        finally:
            self.finish()

    def _on_disconnect(self, disconnect: asyncio.Future[None]) -> None:
        """The client hung up mid-response: close the upstream request, so the engine aborts it
        (the pending read then fails, which ends the body)."""
        if disconnect.cancelled() or self.is_finished:
            return
        self.is_client_gone = True
        self.status_label = "499"
        self.finish()

    def _broken(self, e: UpstreamError, what: str) -> None:
        self.status_label = "broken"
        self.deps.fleet.record_failure(self.replica.url, f"{what}: {e}")
        self.deps.metrics.streams_broken.labels(self.model).inc()
        logger.warning("request %s: replica %s failed mid-response (%s)", self.request_id,
                       self.replica.url, e)  # fmt: skip

    def finish(self) -> None:
        if self.is_finished:
            return
        self.is_finished = True
        deps, model = self.deps, self.model
        self.upstream.close(self.is_complete)
        deps.fleet.admission.release(self.replica)
        deps.metrics.requests.labels(model, self.replica.url, self.status_label).inc()
        deps.metrics.duration.labels(model).observe(time.monotonic() - self.start_s)
        if self.keystore is not None and self.api_key is not None:
            found = _TOTAL_TOKENS.findall(bytes(self.tail))
            if found:
                now = time.monotonic()
                self.keystore.settle_tokens(self.api_key, self.info.estimated_tokens, int(found[-1]), now)


class _PassThrough(StreamingResponse):
    """Sends the body's chunks as they come, and nothing else per chunk.

    Starlette's StreamingResponse starts a task group per response to notice a client leaving
    (under ASGI before 2.4, where sending to a gone client does not fail); the proxy already
    watches for that (`disconnect`, whose callback closes the upstream request and so ends the
    body), so it is not needed here."""

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        disconnect: asyncio.Future[None],
        on_end: Callable[[], None],
        status: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(body, status_code=status, headers=headers)
        self._chunks = body
        self._disconnect = disconnect
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._disconnect.cancel()
            await self._chunks.aclose()
            self._on_end()  # when the body never started, its own `finally` did not run


async def _race(aw: Awaitable[T], disconnect: asyncio.Future[None], on_late: Callable[[T], object]) -> T:
    """Await `aw` unless the client hangs up first; then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    waitables: set[asyncio.Future[Any]] = {task, disconnect}
    try:
        done, _ = await asyncio.wait(waitables, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, UpstreamError, GatewayError):
        raise ClientGone() from None
    maybe = on_late(result)  # finished just before the cancel landed: give it back
    if asyncio.iscoroutine(maybe):
        await maybe
    raise ClientGone()


def _close_unread(response: UpstreamResponse) -> None:
    response.close(complete=False)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"Request body exceeds {max_bytes} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def _route_model(fleet: Fleet, model: str | None) -> str:
    if model is not None:
        if not fleet.registry.has_model(model):
            raise ModelNotFound(model)
        return model
    # No readable model: any replica answers with the engine's own validation error.
    models = fleet.registry.models()
    if not models:
        raise Unavailable("No model is being served yet.", retry_after_s=5.0, code="no_models")
    return models[0]


def _priority(value: str | None) -> int:
    if value is None:
        return 0
    try:
        priority = int(value.strip())
    except ValueError:
        priority = MAX_ABS_PRIORITY + 1
    if abs(priority) > MAX_ABS_PRIORITY:
        raise InvalidRequest(
            f"{PRIORITY_HEADER} must be an integer between -{MAX_ABS_PRIORITY} and {MAX_ABS_PRIORITY}.",
            param=PRIORITY_HEADER,
        )
    return priority


def _upstream_headers(
    request: Request, request_id: str, settings: GatewaySettings, is_auth_enabled: bool
) -> dict[str, str]:
    headers = {
        "content-type": request.headers.get("content-type", "application/json"),
        "accept": request.headers.get("accept", "*/*"),
        "x-request-id": request_id,
    }
    if settings.upstream_api_key:
        headers["authorization"] = f"Bearer {settings.upstream_api_key}"
    elif not is_auth_enabled and "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]  # the engine checks its own key
    return headers


def _with_request_id(response: Response, request_id: str) -> Response:
    response.headers["x-request-id"] = request_id
    return response
