"""Forward one OpenAI request to a replica and stream its answer back byte for byte.

Retries on another replica only before the first response byte (connect error, 5xx, engine queue
full); a stream whose replica dies ends with an SSE error event; a client that hangs up closes
the upstream request, so the engine aborts it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

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
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
T = TypeVar("T")


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
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
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
        finally:
            disconnect.cancel()
    except ClientGone:
        deps.metrics.requests.labels(model, "", "499").inc()
        return Response(status_code=499)
    except GatewayError as e:
        deps.metrics.requests.labels(model, "", str(e.status_code)).inc()
        deps.metrics.rejected.labels(model, e.code or e.error_type).inc()
        return _with_request_id(error_response(e), request_id)
    return _stream_back(deps, upstream, replica, model, info, api_key, request_id, start_s)


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


def _stream_back(
    deps: ProxyDeps,
    upstream: UpstreamResponse,
    replica: Replica,
    model: str,
    info: RequestInfo,
    api_key: ApiKey | None,
    request_id: str,
    start_s: float,
) -> Response:
    fleet, metrics = deps.fleet, deps.metrics
    fleet.observe_headers(replica.url, upstream.headers)
    if upstream.status_code < 500:
        fleet.record_success(replica.url)
    is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    keystore = deps.keys()
    wants_usage = (
        api_key is not None and keystore is not None and api_key.limits.tokens_per_minute is not None
    )
    tail = bytearray()
    finished = False
    is_complete = False
    status_label = str(upstream.status_code)

    async def finish() -> None:
        nonlocal finished
        if finished:
            return
        finished = True
        upstream.close(is_complete)
        fleet.admission.release(replica)
        metrics.requests.labels(model, replica.url, status_label).inc()
        metrics.duration.labels(model).observe(time.monotonic() - start_s)
        if wants_usage and keystore is not None and api_key is not None:
            found = _TOTAL_TOKENS.findall(bytes(tail))
            if found:
                keystore.settle_tokens(api_key, info.estimated_tokens, int(found[-1]), time.monotonic())

    async def body() -> Any:
        nonlocal status_label, is_complete
        is_first = True
        try:
            async for chunk in upstream.chunks():
                if is_first:
                    metrics.ttfb.labels(model).observe(time.monotonic() - start_s)
                    is_first = False
                if wants_usage:
                    tail.extend(chunk)
                    del tail[:-_TAIL_BYTES]
                yield chunk
            is_complete = True
        except UpstreamError as e:
            status_label = "broken"
            fleet.record_failure(replica.url, f"stream: {e}")
            metrics.streams_broken.labels(model).inc()
            logger.warning("request %s: replica %s failed mid-response (%s)", request_id, replica.url,
                           e)  # fmt: skip
            if is_sse:
                yield sse_error_event("The model replica failed while streaming the response.")
        finally:
            await finish()

    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers["x-request-id"] = request_id
    return StreamingResponse(
        body(), status_code=upstream.status_code, headers=headers, background=BackgroundTask(finish)
    )


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
