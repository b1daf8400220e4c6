"""The client hanging up: noticing it, and racing the proxy's waits (queue, upstream head) against it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from corral_gateway.errors import GatewayError
from corral_gateway.upstream import UpstreamError

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def wait_disconnect(request: Request) -> None:
    """Returns once the client has hung up (the request body was already read in full)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race(aw: Awaitable[T], disconnect: asyncio.Future[None], on_late: Callable[[T], None]) -> T:
    """Await `aw` unless the client hangs up first; then cancel it and raise ClientGone. A result
    nobody will use (it arrived just as the cancel landed) goes to `on_late`, to give back what it
    holds.

    `aw` runs in the calling task, not a task of its own: a new task starts only on the event
    loop's next turn, which under load is milliseconds (the gateway's `request` overhead). The
    hang-up cancels the calling task instead, and the cancellation is told apart from any other
    by Task.uncancel. A coroutine cancelled so cleans up after itself, as the upstream client and
    the admission queue do."""
    if disconnect.done():
        if asyncio.iscoroutine(aw):
            aw.close()
        raise ClientGone()
    task = asyncio.current_task()
    assert task is not None, "race runs inside a task"
    waiting, hung_up = True, False

    def on_hang_up(_: asyncio.Future[None]) -> None:
        nonlocal hung_up
        if waiting:  # a callback scheduled just as `aw` finished must not cancel what follows
            hung_up = True
            task.cancel()

    disconnect.add_done_callback(on_hang_up)
    try:
        result = await aw
    except asyncio.CancelledError:
        if isinstance(aw, asyncio.Future) and aw.done() and not aw.cancelled() and aw.exception() is None:
            on_late(aw.result())  # it arrived in the same step as the cancellation
        if hung_up and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    except (UpstreamError, GatewayError):
        if hung_up and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        waiting = False
        disconnect.remove_done_callback(on_hang_up)
    if hung_up and task.uncancel() == 0:  # finished although cancelled: nobody will use it
        on_late(result)
        raise ClientGone()
    return result
