"""The bound on a request's head that the engine's and the gateway's uvicorn servers run with."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from corral_engine.http_limits import MAX_HEAD_BYTES, uvicorn_options


class EchoLength:
    """An ASGI app answering with the number of body bytes it read."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.num_calls += 1
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = str(size).encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def served() -> AsyncIterator[tuple[EchoLength, int]]:
    app = EchoLength()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, **uvicorn_options())
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield app, port
    server.should_exit = True
    await task


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return status, await reader.readexactly(length)


def _request(header_bytes: int, body: bytes = b"") -> bytes:
    return (
        b"POST /x HTTP/1.1\r\nhost: t\r\nx-pad: " + b"a" * header_bytes + b"\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


async def test_a_head_past_the_bound_gets_431_and_never_reaches_the_app(
    served: tuple[EchoLength, int],
) -> None:
    app, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /x HTTP/1.1\r\nhost: t\r\nx-pad: ")
    for _ in range(4):  # a header that never ends, sent in pieces
        writer.write(b"a" * MAX_HEAD_BYTES)
        await writer.drain()
    status, body = await _response(reader)
    assert status == 431
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert await reader.read() == b""  # closed
    assert app.num_calls == 0
    writer.close()


async def test_bodies_do_not_count_and_each_request_on_a_connection_starts_afresh(
    served: tuple[EchoLength, int],
) -> None:
    app, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    near = MAX_HEAD_BYTES - 1024
    big_body = b"b" * (4 * MAX_HEAD_BYTES)
    for body in (big_body, b"", big_body):  # one write each: head and body together
        writer.write(_request(near, body))
        await writer.drain()
        assert await _response(reader) == (200, str(len(body)).encode())
    assert app.num_calls == 3
    writer.close()
