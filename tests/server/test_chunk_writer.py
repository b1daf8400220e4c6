"""ChunkWriter: a streamed body written from plain callbacks, in order, whether or not ASGI's send
waits (a paused connection), and quiet once the connection failed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from corral_engine.server.streaming import ChunkWriter


class Connection:
    """An ASGI send that waits while `paused` is set, as uvicorn's does for a slow reader."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.writable = asyncio.Event()
        self.writable.set()
        self.fail_with: Exception | None = None
        self.calls = 0

    async def send(self, message: dict[str, Any]) -> None:
        self.calls += 1
        if not self.writable.is_set():
            await self.writable.wait()
        if self.fail_with is not None:
            raise self.fail_with
        self.bodies.append(message["body"])


async def test_writes_go_out_at_once_when_the_connection_takes_them() -> None:
    conn = Connection()
    writer = ChunkWriter(conn.send)
    writer.write(b"a")
    writer.write(b"b")
    assert conn.bodies == [b"a", b"b"]  # no task, no await in between
    await writer.drain()
    assert not writer.failed.done()


async def test_a_paused_connection_holds_later_writes_and_sends_them_as_one_in_order() -> None:
    conn = Connection()
    writer = ChunkWriter(conn.send)
    writer.write(b"a")
    conn.writable.clear()
    writer.write(b"b")  # this send waits
    writer.write(b"c")
    writer.write(b"d")
    await asyncio.sleep(0.01)
    assert conn.bodies == [b"a"]
    drained = asyncio.create_task(writer.drain())
    await asyncio.sleep(0.01)
    assert not drained.done()
    conn.writable.set()
    await asyncio.wait_for(drained, 5)
    assert conn.bodies == [b"a", b"b", b"cd"]
    writer.write(b"e")  # writable again: straight out
    assert conn.bodies[-1] == b"e"


@pytest.mark.parametrize("paused", [False, True])
async def test_a_failed_send_sets_failed_and_later_writes_are_dropped(paused: bool) -> None:
    conn = Connection()
    writer = ChunkWriter(conn.send)
    conn.fail_with = OSError("the client went away")
    if paused:
        conn.writable.clear()
    writer.write(b"a")
    writer.write(b"b")
    if paused:
        conn.writable.set()
    await asyncio.wait_for(writer.failed, 5)
    calls = conn.calls
    writer.write(b"c")
    await writer.drain()
    assert conn.bodies == [] and conn.calls == calls


async def test_close_cancels_a_waiting_send() -> None:
    conn = Connection()
    writer = ChunkWriter(conn.send)
    conn.writable.clear()
    writer.write(b"a")
    writer.write(b"b")
    writer.close()
    await asyncio.wait_for(writer.drain(), 5)
    conn.writable.set()
    await asyncio.sleep(0.01)
    assert conn.bodies == []


async def test_an_awaitable_that_is_not_a_coroutine_is_awaited_on_a_task() -> None:
    sent: list[bytes] = []

    def send(message: dict[str, Any]) -> asyncio.Future[None]:
        sent.append(message["body"])
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, future.set_result, None)
        return future

    writer = ChunkWriter(send)  # type: ignore[arg-type]
    writer.write(b"a")
    writer.write(b"b")
    writer.write(b"c")
    await asyncio.wait_for(writer.drain(), 5)
    assert sent == [b"a", b"bc"]
