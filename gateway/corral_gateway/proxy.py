"""Forward one OpenAI request to a replica and its answer back: the orchestration.

Admit (body size, API key, model, priority, rate limits), then attempts on leased replicas, retried
elsewhere only before the first response byte (`attempt`), or on the same ones after a short back-off
when every replica the model has failed it, then the answer passed through byte for byte
(`passthrough`). The lease on a replica is held until the answer has been delivered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

from corral_engine import wire
from opentelemetry.trace import Span
from starlette.requests import Request
from starlette.responses import Response

from corral_gateway import tracing
from corral_gateway.access import AccessLog, Origin
from corral_gateway.admission import Ask
from corral_gateway.attempt import Outgoing, Retry, back_off, same_again_in_s, send_once
from corral_gateway.auth import KeyStore
from corral_gateway.disconnect import ClientGone, wait_disconnect
from corral_gateway.drain import Drain
from corral_gateway.errors import (
    Draining,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ReplicasUnavailable,
    Unavailable,
    error_response,
)
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_names import Route
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.passthrough import Exchange
from corral_gateway.peek import for_adapter, peek_request, with_model
from corral_gateway.quota import TokenUsage
from corral_gateway.registry import Replica
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import Upstream, UpstreamResponse

logger = logging.getLogger(__name__)

PRIORITY_HEADER = "x-corral-priority"
MAX_ABS_PRIORITY = 1000
# A body of more bytes is read (peeked at, renamed for an alias) on a worker thread: a 32 MiB
# conversation of a million short messages is ~7 s of Python to read, and held every other
# client's stream through this gateway, and its /health, for as long.
OFF_LOOP_BODY_BYTES = 64 * 1024
T = TypeVar("T")

# Sends a response to the client (the caller knows, from it being called, that the response began).
Deliver = Callable[[Response], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ProxyDeps:
    settings: GatewaySettings
    fleet: Fleet
    upstream: Upstream
    metrics: GatewayMetrics
    keys: Callable[[], KeyStore | None]
    access: AccessLog
    drain: Drain


@dataclass(frozen=True, slots=True)
class _Ticket:
    """An admitted request: what every attempt needs to lease a replica and send to it."""

    origin: Origin
    outgoing: Outgoing
    prefix_hash: int | None
    priority: int
    fairness_key: str
    quota: TokenUsage | None
    arrived_s: float  # time.perf_counter() as the handler started: the overhead histogram's origin
    block_hashes: tuple[int, ...] = ()


async def proxy(deps: ProxyDeps, request: Request, path: str, request_id: str, deliver: Deliver) -> None:
    """Answer one proxied request through `deliver`; every error the gateway knows is answered in
    OpenAI's shape (an unexpected one propagates, for the app's last resort)."""
    # Done when the client hangs up, or when a drain's time runs out (`deps.drain.is_over`).
    ended = asyncio.get_running_loop().create_future()
    with deps.drain.tracking(ended):
        await _proxy(deps, request, path, request_id, deliver, ended)


@dataclass(slots=True)
class _Caller:
    """Who a request is for, as admission learns it: what its access line names however it ends."""

    request_id: str
    start_s: float  # time.monotonic() as the handler started: the access line's latency origin
    span: Span | None
    model: str = "unknown"
    key_name: str = ""
    quota: TokenUsage | None = None  # its tokens counted against its key, once admitted

    def origin(self) -> Origin:
        return Origin(self.model, self.request_id, self.start_s, self.key_name, self.span)


async def _proxy(
    deps: ProxyDeps,
    request: Request,
    path: str,
    request_id: str,
    deliver: Deliver,
    ended: asyncio.Future[None],
) -> None:
    arrived_s = time.perf_counter()
    span = tracing.start_request_span(request.headers, request.method, path, request_id)
    caller = _Caller(request_id, time.monotonic(), span)
    try:
        if deps.drain.is_draining:
            raise Draining()
        ticket = await _admit(deps, request, path, caller, arrived_s)
        async with _watch_disconnect(request, ended) as disconnect:
            try:
                await _forward(deps, ticket, disconnect, deliver)
            except ClientGone:
                if deps.drain.is_over:  # the drain's time ran out before the answer began
                    raise Draining() from None
                raise
    except ClientGone:
        deps.metrics.count_request(caller.model, "", "499")
        deps.access.finished(caller.origin(), "", "499", None)
        await deliver(Response(status_code=499))
    except GatewayError as e:
        if caller.quota is not None:
            caller.quota.refund()  # shed, timed out or failed in the gateway: no token was served
        deps.metrics.count_request(caller.model, "", str(e.status_code))
        deps.metrics.rejected.labels(caller.model, e.code or e.error_type).inc()
        deps.access.finished(caller.origin(), "", str(e.status_code), None)
        await deliver(with_request_id(error_response(e), request_id))


async def _admit(deps: ProxyDeps, request: Request, path: str, caller: _Caller, arrived_s: float) -> _Ticket:
    """Admit the request (API key, body size, model, priority, rate limits) and read what its
    attempts need; `caller` learns its model, key and quota as they become known."""
    # The key first, from the headers alone: a client without one must not get the gateway to
    # read and hold a body of up to max_request_bytes (30 such uploads held ~0.9 GiB).
    keystore = deps.keys()
    api_key = keystore.authenticate(request.headers) if keystore is not None else None
    caller.key_name = api_key.name if api_key is not None else ""
    raw = await read_body(request, deps.settings.max_request_bytes)
    settings = deps.settings
    chain = settings.affinity_chain_blocks if settings.policy in ("prefix-affinity", "llm-d") else 0
    peek = functools.partial(
        peek_request,
        raw,
        settings.affinity_block_chars,
        settings.affinity_num_blocks,
        chain,
        request.headers.get("content-type"),
        path,
    )
    info = await _off_loop(raw, peek)
    route = _route_model(deps.fleet, info.model)
    caller.model = route.key
    if info.model is not None and route.upstream != info.model:  # an alias: the served name
        raw = await _off_loop(raw, functools.partial(with_model, raw, route.upstream))
    if route.adapter is not None:  # its KV cache is not the base model's: nor its prefix hashes
        info = for_adapter(info, route.adapter)
    priority = _priority(request.headers.get(PRIORITY_HEADER))
    if keystore is not None and api_key is not None:
        keystore.admit(api_key, info.estimated_tokens, time.monotonic())
    headers = _upstream_headers(request, caller.request_id, deps.settings, keystore is not None)
    caller.quota = TokenUsage.track(keystore, api_key, info.estimated_tokens)
    return _Ticket(
        caller.origin(),
        Outgoing(path, raw, headers, info.is_stream, route.adapter),
        info.prefix_hash,
        priority,
        api_key.key_id if api_key is not None else "",
        caller.quota,
        arrived_s,
        info.block_hashes,
    )


async def _forward(
    deps: ProxyDeps, ticket: _Ticket, disconnect: asyncio.Future[None], deliver: Deliver
) -> None:
    """Lease a replica and send; on a `Retry`, give it back and try another until attempts run out
    (the same ones again, after a back-off, once every replica of the model has failed it).

    The overhead histogram's `request` part leaves out the waits for a replica, back-offs and whole
    failed attempts (`excluded_s`): those are the fleet's time, not the gateway's. A replica whose
    own queue was full is not excluded from later attempts; all attempts' waits in the gateway's
    queue share one deadline."""
    fleet, metrics, model = deps.fleet, deps.metrics, ticket.origin.model
    tried: list[str] = []
    wake_timeout_s = fleet.wake_timeout_s(model)
    queue_deadline_s = time.monotonic() + (wake_timeout_s or deps.settings.queue_timeout_s)
    excluded_s = 0.0
    backoff_s: float | None = None  # set when the next attempt goes to a replica that failed already
    for attempt in range(deps.settings.max_attempts):
        if backoff_s is not None:
            excluded_s += await back_off(backoff_s, disconnect)
            tried.clear()
            backoff_s = None
        leasing_s = time.perf_counter()
        ask = Ask(
            model,
            ticket.prefix_hash,
            ticket.priority,
            ticket.fairness_key,
            tried,
            max(0.0, queue_deadline_s - time.monotonic()),
            ticket.block_hashes,
            ticket.outgoing.adapter,
        )
        async with fleet.lease(ask, disconnect) as replica:
            waited_s = time.perf_counter() - leasing_s
            metrics.queue_wait.labels(model).observe(waited_s)
            can_retry = attempt + 1 < deps.settings.max_attempts
            outgoing, upstream_span = _traced(deps, ticket, replica, attempt + 1, waited_s)
            outcome = await _attempt(deps, replica, outgoing, disconnect, tried, can_retry, upstream_span)
            if isinstance(outcome, Retry):
                excluded_s += time.perf_counter() - leasing_s
                backoff_s = _retrying(deps, ticket, replica, outcome, tried, attempt)
                continue
            if outcome.sent_s is not None:
                request_s = outcome.sent_s - ticket.arrived_s - excluded_s - waited_s
                metrics.overhead.labels(model, "request").observe(max(0.0, request_s))
            exchange = Exchange(
                fleet, metrics, outcome, replica, ticket.origin, ticket.quota, deps.access, deps.drain
            )
            try:
                await deliver(await exchange.respond(disconnect))
                exchange.delivered()
            finally:
                exchange.finish()  # a no-op unless the response was cancelled before it started
            return
    raise ReplicasUnavailable(model)


def _retrying(
    deps: ProxyDeps,
    ticket: _Ticket,
    replica: Replica,
    outcome: Retry,
    tried: list[str],
    attempt: int,
) -> float | None:
    """Count and log a failed attempt, `tried` learning its replica unless that one only had no
    room; returns the back-off before the same replicas are tried again (None: not them)."""
    model, request_id = ticket.origin.model, ticket.origin.request_id
    if not outcome.is_full:
        tried.append(replica.url)
    deps.metrics.retries.labels(model, outcome.label).inc()
    backoff_s = None
    if attempt + 1 < deps.settings.max_attempts:
        backoff_s = same_again_in_s(deps.fleet, model, ticket.outgoing, outcome, tried, attempt)
    again = "" if backoff_s is None else f"; no other replica: tried again in {backoff_s:.2f} s"
    logger.warning("request %s: replica %s %s (%s); attempt %d%s", request_id, replica.url,
                   "had no room" if outcome.is_full else "failed", outcome.label, attempt + 1, again,
                   extra={"request_id": request_id})  # fmt: skip
    return backoff_s


def _traced(
    deps: ProxyDeps, ticket: _Ticket, replica: Replica, attempt: int, waited_s: float
) -> tuple[Outgoing, Span | None]:
    """The attempt's request and its upstream span: when the request is traced, the pick is
    recorded on its span and the request carries the upstream span's context to the replica."""
    span = ticket.origin.span
    if span is None:
        return ticket.outgoing, None
    scores = deps.fleet.scores(ticket.origin.model)
    queued_s = time.monotonic() - waited_s
    tracing.record_pick(span, queued_s, deps.settings.policy, replica.url, scores, attempt)
    upstream_span, carrier = tracing.start_upstream_span(span, replica.url, attempt)
    outgoing = ticket.outgoing
    return replace(outgoing, headers={**outgoing.headers, **carrier}), upstream_span


async def _attempt(
    deps: ProxyDeps,
    replica: Replica,
    outgoing: Outgoing,
    disconnect: asyncio.Future[None],
    tried: list[str],
    can_retry: bool,
    span: Span | None,
) -> UpstreamResponse | Retry:
    """One `send_once`, timed by the attempt's upstream span when tracing."""
    if span is None:
        return await send_once(deps.fleet, deps.upstream, replica, outgoing, disconnect, tried, can_retry)
    try:
        outcome = await send_once(deps.fleet, deps.upstream, replica, outgoing, disconnect, tried, can_retry)
    except BaseException as e:
        tracing.end_upstream_span(span, None, type(e).__name__)
        raise
    if isinstance(outcome, Retry):
        tracing.end_upstream_span(span, outcome.status, outcome.label)
    else:
        tracing.end_upstream_span(span, outcome.status_code, None)
    return outcome


@asynccontextmanager
async def _watch_disconnect(
    request: Request, ended: asyncio.Future[None]
) -> AsyncIterator[asyncio.Future[None]]:
    """`ended`, done from now on also once the client hangs up (watched for as long as the block
    runs); cancelled when the block ends, or by the response once it no longer needs it."""
    watcher = asyncio.ensure_future(wait_disconnect(request))

    def hung_up(done: asyncio.Future[None]) -> None:
        if not done.cancelled() and not ended.done():
            ended.set_result(None)

    watcher.add_done_callback(hung_up)
    try:
        yield ended
    finally:
        watcher.cancel()
        ended.cancel()


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:  # refused before a byte of it is read
        raise PayloadTooLarge(f"Request body exceeds {max_bytes} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"Request body exceeds {max_bytes} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def _off_loop(raw: bytes, fn: Callable[[], T]) -> T:
    """fn() reading `raw`: right here for a small body, on a worker thread for a large one."""
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return fn()
    return await asyncio.to_thread(fn)


def _route_model(fleet: Fleet, model: str | None) -> Route:
    """The pool to route to, the model name to send upstream and the LoRA adapter asked for: an
    alias or a NAMESPACE/NAME is sent under the deployment's served name, an adapter under its
    own; any other body goes through byte for byte."""
    if model is not None:
        route = fleet.resolve(model)
        if not fleet.has_model(route.key) or fleet.is_unserved(route):
            raise ModelNotFound(model)
        return route
    # No readable model: any replica answers with the engine's own validation error.
    models = fleet.models()
    if not models:
        raise Unavailable("No model is being served yet.", retry_after_s=5.0, code="no_models")
    return Route(models[0], models[0])


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
        wire.HEADER_REQUEST_ID: request_id,
        **tracing.client_context(request.headers),
    }
    if settings.upstream_api_key:
        headers["authorization"] = f"Bearer {settings.upstream_api_key}"
    elif not is_auth_enabled and "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]  # the engine checks its own key
    return headers


def with_request_id(response: Response, request_id: str) -> Response:
    response.headers[wire.HEADER_REQUEST_ID] = request_id
    return response
