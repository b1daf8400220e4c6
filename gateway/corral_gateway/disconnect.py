"""The client hanging up: noticing it, and racing the proxy's waits (queue, upstream head) against it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

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
    nobody will use (it arrived just as the cancel landed) goes to `on_late`, to give back what it holds."""
    task = asyncio.ensure_future(aw)
    waitables: set[asyncio.Future[Any]] = {task, disconnect}
    try:
        done, _ = await asyncio.wait(waitables, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        if task.done() and not task.cancelled() and task.exception() is None:
            on_late(task.result())
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, UpstreamError, GatewayError):
        raise ClientGone() from None
    on_late(result)
    raise ClientGone()
