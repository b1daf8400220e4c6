"""The upstream client's failure kinds, against real loopback sockets that misbehave on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from corral_gateway.upstream import (
    ConnectFailed,
    Dropped,
    ReadTimedOut,
    Upstream,
    UpstreamConfig,
    UpstreamError,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CONFIG = UpstreamConfig(max_connections=8, connect_timeout_s=2.0, read_timeout_s=0.5)


@asynccontextmanager
async def tcp_server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def read_head(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length")), 0)
    await reader.readexactly(length)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_refused_connection_is_a_connect_failure() -> None:
    async with Upstream(CONFIG) as upstream:
        with pytest.raises(ConnectFailed):
            await upstream.post(f"http://127.0.0.1:{closed_port()}/v1/completions", b"{}", {})


async def test_no_answer_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await asyncio.sleep(5)

    async with tcp_server(silent) as url, Upstream(CONFIG) as upstream:
        with pytest.raises(ReadTimedOut):
            await upstream.post(url + "/v1/completions", b"{}", {})


async def test_a_connection_closed_before_the_response_is_dropped() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.close()

    async with tcp_server(hang_up) as url, Upstream(CONFIG) as upstream:
        with pytest.raises(Dropped):
            await upstream.post(url + "/v1/completions", b"{}", {})


async def test_body_passes_through_untouched_and_a_cut_stream_raises() -> None:
    body = b'data: {"x": 1}\n\n'

    async def half_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(body), body))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # no terminating chunk: the replica died mid-stream

    async with tcp_server(half_stream) as url, Upstream(CONFIG) as upstream:
        response = await upstream.post(url + "/v1/completions", b"{}", {"content-type": "application/json"})
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        received = b""
        with pytest.raises(UpstreamError):
            async for chunk in response.chunks():
                received += chunk
        response.close(complete=False)
    # Not decompressed although it claims gzip, and de-chunked: the bytes the replica sent.
    assert received == body


@pytest.mark.parametrize("num_bytes", [2, 1 << 20])
async def test_a_response_knows_when_its_request_was_sent(num_bytes: int) -> None:
    """`sent_s`: once the request's bytes were all written, before the replica answered (the
    gateway's overhead histogram times its `request` part to it)."""
    answering_s: list[float] = []

    async def answer_later(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await asyncio.sleep(0.05)
        answering_s.append(time.perf_counter())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    body = b"x" * num_bytes
    async with tcp_server(answer_later) as url, Upstream(CONFIG) as upstream:
        posting_s = time.perf_counter()
        response = await upstream.post(url + "/v1/completions", body, {"content-type": "text/plain"})
        assert response.sent_s is not None and posting_s < response.sent_s < answering_s[0]
        assert await response.read() == b"ok"
        response.close(complete=True)


async def test_a_stream_closed_mid_read_leaves_nothing_behind() -> None:
    """A client that drops a stream makes the gateway close the upstream response while the body's
    read is pending (passthrough's disconnect callback), so the read fails. Nothing of that
    connection may outlive it: aiohttp keeps the error on the stream, and with the error's traceback
    kept that was a loop no collector pass freed, one for each stream a client dropped."""

    async def streaming(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        writer.write(head)
        with contextlib.suppress(ConnectionError):
            for _ in range(200):
                writer.write(b"9\r\ndata: x\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)

    def connections_alive() -> int:
        gc.collect()
        return sum(type(o).__name__ == "ResponseHandler" for o in gc.get_objects())

    async def drop_mid_read(upstream: Upstream, url: str) -> int:
        response = await upstream.post(url + "/v1/chat/completions", b"{}", {})
        chunks = 0

        async def relay() -> None:
            nonlocal chunks
            with contextlib.suppress(UpstreamError):
                async for _ in response.chunks():
                    chunks += 1

        reading = asyncio.create_task(relay())
        await asyncio.sleep(0.05)
        response.close(complete=False)
        await reading
        return chunks

    async with tcp_server(streaming) as url, Upstream(CONFIG) as upstream:
        before = connections_alive()
        for _ in range(5):
            assert await drop_mid_read(upstream, url) >= 1
        assert connections_alive() == before
