"""The load poll's own HTTP/1.1 client, against a fake replica and raw sockets that misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from corral_engine import wire
from corral_gateway.health_probe import HealthProbe
from corral_gateway.upstream import ConnectFailed, Dropped, ReadTimedOut

from tests.gateway.conftest import FakeEngine, serve

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _probing(handle: Handler) -> AsyncIterator[HealthProbe]:
    """A probe of a raw replica answering with `handle`; both closed at the end."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    probe = HealthProbe(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        yield probe
    finally:
        probe.close()
        server.close()


async def test_reads_the_load_headers_over_one_kept_alive_connection() -> None:
    engine = FakeEngine(num_running=3, num_waiting=2, kv_usage=0.5, health_has_load=True)
    async with serve(engine.app()) as (url, server):
        probe = HealthProbe(url)
        try:
            for _ in range(3):
                fetched = await probe.get(1.0, 1.0)
                assert fetched.status == 200 and fetched.body == b'{"ok":true}'
                assert fetched.headers[wire.HEADER_NUM_WAITING] == "2"
            assert len(server.server_state.connections) == 1
            engine.is_healthy = False
            assert (await probe.get(1.0, 1.0)).status == 503
        finally:
            probe.close()


async def test_a_connection_the_replica_closed_is_replaced_once() -> None:
    num_connections = 0

    async def one_answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal num_connections
        num_connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-corral-num-running: 1\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive ends here, unannounced (as an idle timeout would)

    async with _probing(one_answer_each) as probe:
        for _ in range(3):
            assert (await probe.get(1.0, 1.0)).headers["x-corral-num-running"] == "1"
            await asyncio.sleep(0.05)
        assert num_connections == 3


async def test_refused_and_silent_replicas_raise_the_upstream_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ConnectFailed):
        await HealthProbe(f"http://127.0.0.1:{closed}").get(1.0, 1.0)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with _probing(silent) as probe:
        with pytest.raises(ReadTimedOut):
            await probe.get(0.2, 1.0)


def test_only_plain_http() -> None:
    with pytest.raises(ValueError, match="plain HTTP"):
        HealthProbe("https://replica:8443")


def _raw_replica(answer: bytes, *, close: bool) -> tuple[Handler, list[int]]:
    """A replica that sends `answer` to every request (closing after it if `close`); the list
    counts connections."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
                if close:
                    break
        writer.close()

    return handle, connections


@pytest.mark.parametrize(
    ("answer", "close", "body", "reused"),
    [
        # chunked: read whole, and the connection stays open
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nload\r\n3\r\n ok\r\n0\r\n\r\n",
            False,
            b"load ok",
            True,
        ),
        # neither length nor chunks: the close ends the body
        (b"HTTP/1.1 200 OK\r\nx-corral-num-running: 1\r\n\r\nclosed here", True, b"closed here", False),
        (b"HTTP/1.1 204 No Content\r\n\r\n", False, b"", True),
    ],
    ids=["chunked", "close-delimited", "no-content"],
)
async def test_bodies_end_where_http_says(answer: bytes, close: bool, body: bytes, reused: bool) -> None:
    handle, connections = _raw_replica(answer, close=close)
    async with _probing(handle) as probe:
        for _ in range(2):
            fetched = await probe.get(1.0, 1.0)
            assert fetched.body == body
        assert len(connections) == (1 if reused else 2)


@pytest.mark.parametrize(
    "answer",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",  # then closed: cut short
    ],
    ids=["garbage", "truncated"],
)
async def test_malformed_or_truncated_responses_are_dropped(answer: bytes) -> None:
    async with _probing(_raw_replica(answer, close=True)[0]) as probe:
        with pytest.raises(Dropped):
            await probe.get(1.0, 1.0)
