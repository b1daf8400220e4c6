"""A replica's load poll over its own kept-alive HTTP/1.1 connection: one fixed GET, the response
parsed by httptools (llhttp, the parser uvicorn serves with) from the event loop's stream reader.

The gateway polls every replica ~13 times a second. Through aiohttp a poll cost ~0.4 ms of the
gateway's CPU (a parser, timers, header objects and often a new pooled connection, since streams
borrow the pool's), so polls alone kept 0.1-0.15 cores busy at 16-64 idle replicas. This writes
the same bytes every time and feeds what comes back to one parser. Failures are the upstream
client's exceptions, so the fleet treats them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

import httptools

from corral_gateway.upstream import ConnectFailed, ConnectTimedOut, Dropped, Fetched, ReadTimedOut

_READ_BYTES = 64 * 1024
_MAX_BODY_BYTES = 1024 * 1024


class HealthProbe:
    """GET `path` on one plain-HTTP replica, reusing the connection; `close` when done."""

    def __init__(self, url: str, path: str = "/health") -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"{url!r}: the probe speaks plain HTTP only")
        self.host, self.port = parts.hostname, parts.port or 80
        host_header = parts.netloc.rsplit("@", 1)[-1]
        prefix = parts.path.rstrip("/")
        self._request = f"GET {prefix}{path} HTTP/1.1\r\nhost: {host_header}\r\n\r\n".encode("latin-1")
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def get(self, timeout_s: float, connect_timeout_s: float) -> Fetched:
        """The response (header names lower-cased). A kept-alive connection the replica closed
        meanwhile is replaced once, as any HTTP client does."""
        is_reused = self._streams is not None
        try:
            return await self._exchange(timeout_s, connect_timeout_s)
        except Dropped:
            self.close()
            if not is_reused:
                raise
        return await self._exchange(timeout_s, connect_timeout_s)

    async def _exchange(self, timeout_s: float, connect_timeout_s: float) -> Fetched:
        if self._streams is None:
            try:
                # Not asyncio.wait_for: on Python 3.11 a cancel that lands as the connect fails is
                # lost (the OSError comes out instead), and the poller it ran in, told to stop,
                # polled on: a gateway that could not bind its port never exited.
                async with asyncio.timeout(connect_timeout_s):
                    self._streams = await asyncio.open_connection(self.host, self.port)
            except TimeoutError as e:
                raise ConnectTimedOut(type(e).__name__) from e
            except OSError as e:
                raise ConnectFailed(type(e).__name__) from e
        reader, writer = self._streams
        try:
            async with asyncio.timeout(timeout_s):
                writer.write(self._request)
                response = _Response()
                parser = response.parser = httptools.HttpResponseParser(response)
                while not response.is_complete:
                    data = await reader.read(_READ_BYTES)
                    if not data:
                        response.end_of_stream()
                        break
                    parser.feed_data(data)
                fetched = Fetched(parser.get_status_code(), response.headers, bytes(response.body))
                keep_alive = response.keep_alive
        except TimeoutError as e:
            self.close()
            raise ReadTimedOut(type(e).__name__) from e
        except (OSError, asyncio.IncompleteReadError, httptools.HttpParserError, ValueError) as e:
            self.close()
            raise Dropped(type(e).__name__) from e
        if not keep_alive:
            self.close()
        return fetched

    def close(self) -> None:
        if self._streams is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._streams[1].close()
            self._streams = None


class _Response:
    """httptools' callbacks for one response: header names lower-cased, the body (bounded)."""

    __slots__ = ("body", "has_head", "headers", "is_complete", "keep_alive", "parser")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.has_head = False
        self.is_complete = False
        self.keep_alive = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.has_head = True

    def on_body(self, body: bytes) -> None:
        if len(self.body) + len(body) > _MAX_BODY_BYTES:
            raise ValueError(f"a body over {_MAX_BODY_BYTES} bytes")
        self.body += body

    def on_message_complete(self) -> None:
        self.is_complete = True
        # Read here: llhttp forgets it once the message is over.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()

    def end_of_stream(self) -> None:
        """The replica closed the connection: a whole response only if its body had no declared
        end (no length, not chunked), which the close delimits."""
        delimited = "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "")
        if not self.has_head or delimited:
            raise asyncio.IncompleteReadError(bytes(self.body), None)
