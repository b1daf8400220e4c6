"""Start chosen coroutines' tasks eagerly on Python 3.11, as 3.12's `eager_start` does.

A task's first step normally runs a loop turn after `create_task`: behind every callback already
queued and one more poll for I/O. aiohttp (3.11 only; it starts the task eagerly on 3.12+) writes a
request's body in a task of its own, so under a hundred busy streams every upstream request waits
that turn, a millisecond or more, before its first byte leaves. `EagerStart` is a task factory
that runs the first step of the coroutines whose code it was given right away, in the caller's
task, and hands the rest, if any, to a task; other coroutines get plain tasks.

As with 3.12's eager tasks, a coroutine that finishes in its first step never becomes a task: the
factory returns a finished future (the documented contract of a task factory: a Future-compatible
object), whose `done()` callers such as aiohttp check. Unlike them, the first step runs under the
caller's task, so it must not use `asyncio.current_task()` or a timeout scope there; aiohttp's body
write uses neither.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator, Iterable
from types import CodeType
from typing import Any, TypeVar

_T = TypeVar("_T")
_Steppable = Generator[Any, None, Any] | Coroutine[Any, Any, Any]


class _Resumed:
    """Awaiting it goes on with a coroutine whose first step already ran and yielded `yielded`,
    passing what the awaiting task sends or throws through to it."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: _Steppable, yielded: Any) -> None:
        self._coro = coro
        self._yielded = yielded

    def __await__(self) -> Generator[Any, None, Any]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                try:
                    yield yielded
                except BaseException as exc:  # thrown in by the task: a cancellation
                    yielded = coro.throw(exc)
                else:
                    yielded = coro.send(None)
            except StopIteration as stop:
                return stop.value


async def _resume(coro: _Steppable, yielded: Any) -> Any:
    return await _Resumed(coro, yielded)


class EagerStart:
    """A task factory (`loop.set_task_factory`) starting coroutines of the given code eagerly."""

    def __init__(self, codes: Iterable[CodeType]) -> None:
        self._codes = frozenset(codes)

    def __call__(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Generator[Any, None, _T] | Coroutine[Any, Any, _T],
        /,
        context: contextvars.Context | None = None,
    ) -> asyncio.Future[_T]:
        if getattr(coro, "cr_code", None) not in self._codes:
            return asyncio.Task(coro, loop=loop, context=context)
        try:
            if context is None:
                yielded = coro.send(None)
            else:
                yielded = context.run(coro.send, None)
        except StopIteration as stop:
            return _finished(loop, stop.value, None)
        except BaseException as exc:
            return _finished(loop, None, exc)
        return asyncio.Task(_resume(coro, yielded), loop=loop, context=context)


def _finished(loop: asyncio.AbstractEventLoop, value: Any, exc: BaseException | None) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = loop.create_future()
    if exc is None:
        future.set_result(value)
    elif isinstance(exc, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(exc)
    return future


def install(loop: asyncio.AbstractEventLoop, codes: Iterable[CodeType]) -> EagerStart | None:
    """Make `loop` start coroutines of `codes` eagerly, unless it has a task factory already;
    returns the factory installed (for `uninstall`), or None."""
    if loop.get_task_factory() is not None:
        return None
    factory = EagerStart(codes)
    loop.set_task_factory(factory)
    return factory


def uninstall(loop: asyncio.AbstractEventLoop, factory: EagerStart | None) -> None:
    """Undo `install` if its factory is still the loop's."""
    if factory is not None and loop.get_task_factory() is factory:
        loop.set_task_factory(None)
