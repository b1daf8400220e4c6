"""Eagerly started tasks on Python 3.11 (`eager_start`), and the upstream client writing a
request's bytes from the posting task itself (no loop turn before they leave)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.http_writer
import pytest
from corral_gateway import eager_start
from corral_gateway.upstream import Upstream

from tests.gateway.test_gateway_upstream import CONFIG, read_head, tcp_server


async def _steps(log: list[str], gate: asyncio.Future[str]) -> str:
    log.append("first step")
    try:
        got = await gate
    except asyncio.CancelledError:
        log.append("cancelled")
        raise
    log.append("second step")
    return got + "!"


async def _at_once(log: list[str]) -> int:
    log.append("ran")
    return 7


async def _fails_at_once() -> None:
    raise ValueError("no")


@pytest.fixture
async def eager_loop() -> AsyncIterator[asyncio.AbstractEventLoop]:
    loop = asyncio.get_running_loop()
    factory = eager_start.install(loop, [_steps.__code__, _at_once.__code__, _fails_at_once.__code__])
    assert factory is not None
    yield loop
    eager_start.uninstall(loop, factory)
    assert loop.get_task_factory() is None


async def test_a_chosen_coroutine_runs_its_first_step_inside_create_task(
    eager_loop: asyncio.AbstractEventLoop,
) -> None:
    log: list[str] = []
    gate: asyncio.Future[str] = eager_loop.create_future()
    task = asyncio.create_task(_steps(log, gate))
    assert log == ["first step"]  # before any loop turn
    gate.set_result("go")
    assert await task == "go!"
    assert log == ["first step", "second step"]


async def test_other_coroutines_start_a_loop_turn_later(eager_loop: asyncio.AbstractEventLoop) -> None:
    log: list[str] = []

    async def other() -> None:
        log.append("ran")

    task = asyncio.create_task(other())
    assert log == []
    await task
    assert log == ["ran"]


async def test_cancelling_a_resumed_task_reaches_the_coroutine(eager_loop: asyncio.AbstractEventLoop) -> None:
    log: list[str] = []
    gate: asyncio.Future[str] = eager_loop.create_future()
    task = asyncio.create_task(_steps(log, gate))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["first step", "cancelled"]
    assert gate.cancelled()


async def test_a_coroutine_done_in_its_first_step_gives_a_finished_future(
    eager_loop: asyncio.AbstractEventLoop,
) -> None:
    log: list[str] = []
    done = asyncio.create_task(_at_once(log))
    assert done.done() and done.result() == 7 and log == ["ran"]
    failed = asyncio.create_task(_fails_at_once())
    assert failed.done()
    with pytest.raises(ValueError):
        failed.result()


async def test_an_existing_task_factory_is_left_alone() -> None:
    loop = asyncio.get_running_loop()

    def theirs(loop: asyncio.AbstractEventLoop, coro: Any, context: Any = None) -> asyncio.Task[Any]:
        return asyncio.Task(coro, loop=loop, context=context)

    loop.set_task_factory(theirs)
    try:
        assert eager_start.install(loop, [_steps.__code__]) is None
        eager_start.uninstall(loop, None)
        assert loop.get_task_factory() is theirs
    finally:
        loop.set_task_factory(None)


@pytest.mark.parametrize("num_bytes", [2, 4096])
async def test_the_posting_task_writes_the_request_itself(
    monkeypatch: pytest.MonkeyPatch, num_bytes: int
) -> None:
    """The request's bytes leave from the task that posts, within `send`: no task of aiohttp's
    own for the body, which would first run a loop turn later (behind every busy stream)."""
    writers: list[asyncio.Task[Any] | None] = []
    writer_class = aiohttp.http_writer.StreamWriter
    write, writelines = writer_class._write, writer_class._writelines

    def spy_write(self: Any, chunk: Any) -> None:
        writers.append(asyncio.current_task())
        write(self, chunk)

    def spy_writelines(self: Any, chunks: Any) -> None:
        writers.append(asyncio.current_task())
        writelines(self, chunks)

    monkeypatch.setattr(writer_class, "_write", spy_write)
    monkeypatch.setattr(writer_class, "_writelines", spy_writelines)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with tcp_server(answer) as url, Upstream(CONFIG) as upstream:
        poster = asyncio.current_task()
        response = await upstream.post(
            url + "/v1/completions", b"x" * num_bytes, {"content-type": "text/plain"}
        )
        assert await response.read() == b"ok"
        response.close(complete=True)
    assert writers and all(task is poster for task in writers)
    assert asyncio.get_running_loop().get_task_factory() is None  # closing the upstream removed it
