"""One attempt at one leased replica: send the request and classify what came back before the first
body byte (an event stream's first event): a response to pass through, a `Retry` (elsewhere; for a
replica whose own queue is full, or a model's only replica, there again once it has room or after a
back-off), or an error for the client."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

from corral_engine import wire

from corral_gateway.disconnect import ClientGone, race
from corral_gateway.errors import ReplicasUnavailable, UpstreamTimeout
from corral_gateway.fleet import Fleet
from corral_gateway.metrics import RetryReason
from corral_gateway.registry import Replica
from corral_gateway.upstream import (
    ConnectFailed,
    ConnectTimedOut,
    Dropped,
    ReadTimedOut,
    Upstream,
    UpstreamError,
    UpstreamResponse,
)


@dataclass(frozen=True, slots=True)
class Retry:
    """The replica gave no usable answer before the first byte: the request may go to another one.
    Either the connection failed (`reason`) or the replica answered a retryable `status`;
    `is_full`: a 429 for its own queue being full, so not a fault of it: the request may go back
    to it once it has room."""

    reason: RetryReason | None = None
    status: int | None = None
    is_full: bool = False

    @property
    def label(self) -> str:
        """The `reason` label of corral_gateway_retries_total."""
        return self.reason if self.reason is not None else f"http_{self.status}"


# Before a replica that failed a request is tried again (the model has no other): a base doubled on
# each attempt, jittered over its upper half. A connect that timed out while the gateway's event
# loop was stalled (a burst on a saturated machine: stalls of 0.5-1.4 s measured) succeeds once the
# stall is over; the jitter spreads a burst's retries so they do not stall the loop together again.
RETRY_BACKOFF_S = 0.5


@dataclass(frozen=True, slots=True)
class Outgoing:
    """The request as every attempt sends it: the client's original bytes and the upstream headers."""

    path: str
    body: bytes
    headers: dict[str, str]
    is_stream: bool = False  # the body asks for a stream (`"stream": true`)
    adapter: str | None = None  # the LoRA adapter it asks for: only replicas listing it may take it


async def send_once(
    fleet: Fleet,
    upstream: Upstream,
    replica: Replica,
    request: Outgoing,
    disconnect: asyncio.Future[None],
    exclude: list[str],
    can_retry: bool,
) -> UpstreamResponse | Retry:
    """The replica's response (to pass through), or why to retry elsewhere. Raises ClientGone or
    UpstreamTimeout; the caller's lease gives the replica back in every case."""
    try:
        response = await race(
            upstream.post(replica.url + request.path, request.body, request.headers, request.is_stream),
            disconnect,
            on_late=_close_unread,
        )
    except ReadTimedOut as e:
        if not request.is_stream:
            # A non-streamed answer comes whole once generated: a long generation is slow, not a
            # fault of the replica's (a stopped one is ejected by its unanswered health polls).
            raise UpstreamTimeout(
                "The model replica did not finish the response in time.", code="response_timeout"
            ) from e
        fleet.record_failure(replica.url, str(e))
        raise UpstreamTimeout("The model replica did not answer in time.") from e
    except ConnectTimedOut as e:
        if fleet.is_loop_stalled():  # the gateway's own stall, not the replica's
            return Retry("connect_timeout_loop_stall")
        fleet.record_failure(replica.url, str(e))
        return Retry("connect_timeout")
    except ConnectFailed as e:
        fleet.record_failure(replica.url, str(e))
        return Retry("connect_error")
    except Dropped:
        # Dropped before any response: a dying replica, or a keep-alive connection the replica
        # closed just as it was reused. Safe to retry; only connect errors and 5xx count
        # towards ejection, so a race cannot eject a healthy replica.
        return Retry("transport_error")
    status = response.status_code
    if status == 429 and await _is_queue_full(response, disconnect):
        # Not a fault of the replica's: the next attempt waits, in the gateway's queue if need be,
        # for room there or elsewhere. The last attempt's 429 is passed on.
        fleet.record_refusal(replica, _retry_after_s(response.headers), response.headers)
        if can_retry:
            response.close(complete=True)
            return Retry(status=status, is_full=True)
    can_go_elsewhere = can_retry and fleet.has_candidates(
        replica.model, [*exclude, replica.url], request.adapter
    )
    is_retryable = status >= 500 or status == 429  # another 429 (a proxy's, say): tried elsewhere
    if is_retryable and can_go_elsewhere:
        response.close(complete=False)
        if status >= 500:
            fleet.record_failure(replica.url, f"HTTP {status}")
        return Retry(status=status)
    if status == 200 and response.is_event_stream:
        return await _first_event(fleet, replica, response, disconnect, can_retry)
    return response


async def _first_event(
    fleet: Fleet,
    replica: Replica,
    response: UpstreamResponse,
    disconnect: asyncio.Future[None],
    can_retry: bool,
) -> UpstreamResponse | Retry:
    """An event stream's head comes at once, its first event with the first tokens: until then
    (the replica's queue, the prompt's prefill) nothing has reached the client, so a replica dying
    then is a retry (elsewhere, or there again if it is the model's only one), not a stream ended
    by an error event."""
    try:
        await race(response.read_first(), disconnect, on_late=lambda _: None)
    except ClientGone:
        response.close(complete=False)
        raise
    except ReadTimedOut as e:
        response.close(complete=False)
        fleet.record_failure(replica.url, str(e))
        raise UpstreamTimeout("The model replica did not answer in time.") from e
    except UpstreamError as e:
        response.close(complete=False)
        fleet.record_failure(replica.url, f"stream: {e}")
        if can_retry:
            return Retry("transport_error")
        raise ReplicasUnavailable(replica.model) from e  # nothing reached the client: a retry is safe
    return response


def same_again_in_s(
    fleet: Fleet, model: str, request: Outgoing, outcome: Retry, tried: list[str], attempt: int
) -> float | None:
    """The back-off before trying the same replicas again, when the request failed before its first
    byte (nothing reached the client) on every replica of its model in rotation (one at least), as
    Envoy retries a previous host when no other is left; None: another one is left, or none at all."""
    if outcome.reason is None:  # an HTTP answer (a 5xx): the replica's own, passed on when alone
        return None
    if fleet.has_candidates(model, tried, request.adapter) or not fleet.has_candidates(
        model, (), request.adapter
    ):
        return None
    return RETRY_BACKOFF_S * 2**attempt * random.uniform(0.5, 1.0)


async def back_off(delay_s: float, disconnect: asyncio.Future[None]) -> float:
    """Wait `delay_s` unless the client hangs up first (ClientGone); returns the seconds waited."""
    started_s = time.perf_counter()
    await race(asyncio.sleep(delay_s), disconnect, on_late=lambda _: None)
    return time.perf_counter() - started_s


# An engine's 429 is a short JSON error; a longer body is not one to read before passing it on.
_MAX_ERROR_BYTES = 64 * 1024
_MAX_REFUSAL_S = 10.0  # a replica's Retry-After is taken up to this long


async def _is_queue_full(response: UpstreamResponse, disconnect: asyncio.Future[None]) -> bool:
    """Whether a 429 says the replica's own waiting queue is full (the engine's `code`), rather than
    a limit on the client that another try would meet too. Its body is read (and kept for the relay)."""
    length = response.headers.get("content-length", "")
    if not length.isdigit() or int(length) > _MAX_ERROR_BYTES:
        return False
    try:
        body = await race(response.read(), disconnect, on_late=lambda _: None)
    except ClientGone:
        response.close(complete=False)
        raise
    except UpstreamError:
        return False  # passed on: reading it again fails, and the relay answers 502
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == wire.CODE_QUEUE_FULL


def _retry_after_s(headers: dict[str, str]) -> float:
    value = headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        return 1.0  # the engine's default
    return min(_MAX_REFUSAL_S, max(0.0, seconds))


def _close_unread(response: UpstreamResponse) -> None:
    response.close(complete=False)
