"""The gateway's one HTTP client towards replicas (aiohttp), and the only place its errors are read.

aiohttp parses responses in C and hands out pooled connections in constant time, so forwarding an
SSE chunk costs a few microseconds of the gateway's CPU; on a machine it shares with engines that
is throughput the engines keep. Bodies pass through untouched: no decompression, no cookies, no
proxy settings from the environment.

Failures become the four exceptions below, which the proxy maps to retries and errors:
`ConnectFailed` / `ConnectTimedOut` (nothing was sent: retry elsewhere), `Dropped` (the connection
broke before a response: safe to retry) and `ReadTimedOut` (no first byte in time: for a stream,
`read_timeout_s`; for a non-streamed answer, which comes whole once generated, `response_timeout_s`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.connector import Connection

from corral_gateway import eager_start

# Waiting for a free pooled connection, on top of the connect timeout itself.
_POOL_WAIT_S = 30.0
_CHUNK_LIMIT = 2**16


class UpstreamError(Exception):
    """A replica could not be reached or stopped answering."""


class ConnectFailed(UpstreamError):
    pass


class ConnectTimedOut(UpstreamError):
    pass


class ReadTimedOut(UpstreamError):
    pass


class Dropped(UpstreamError):
    pass


def _translate(e: BaseException) -> UpstreamError:
    """The gateway's own error for an aiohttp one, which loses its traceback here: aiohttp keeps
    the error on the response's stream (and re-raises it to every later read), and its traceback
    holds the frames that were reading, which hold the stream and the connection. Kept, that loop
    outlived every collector pass, one connection's objects for each stream a client dropped
    (`python -m bench.soak`; `tests/gateway/test_gateway_upstream.py`)."""
    e.with_traceback(None)
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return ConnectTimedOut(type(e).__name__)
    if isinstance(e, aiohttp.ClientConnectorError):
        return ConnectFailed(type(e).__name__)
    if isinstance(e, TimeoutError):  # includes aiohttp's read timeout
        return ReadTimedOut(type(e).__name__)
    return Dropped(type(e).__name__)


class _StampedResponse(aiohttp.ClientResponse):
    # time.perf_counter() once the request's bytes had all been handed to the connection: what the
    # gateway's overhead histogram times its `request` part to.
    sent_s: float | None = None


class _StampedRequest(aiohttp.ClientRequest):
    """aiohttp's request, stamping its response with the time the body was written. The body goes
    out in a task of its own, started eagerly (aiohttp on Python 3.12+, `eager_start` below that
    while an `Upstream` is open): written within `send`, before the response exists, unless the
    connection pushes back, in which case the write ends after `send` returns."""

    _written_s: float | None = None

    async def write_bytes(self, *args: Any, **kwargs: Any) -> None:
        await super().write_bytes(*args, **kwargs)
        now = time.perf_counter()
        if isinstance(self.response, _StampedResponse):
            self.response.sent_s = now
        else:
            self._written_s = now

    async def send(self, conn: Connection) -> aiohttp.ClientResponse:
        response = await super().send(conn)
        if isinstance(response, _StampedResponse) and response.sent_s is None:
            # Written already, or the head is out and a pending write moves the stamp on.
            response.sent_s = self._written_s if self._written_s is not None else time.perf_counter()
        return response


class UpstreamResponse:
    """A response whose body is read as it arrives; `close` must be called exactly once."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers: dict[str, str] = {k.lower(): v for k, v in response.headers.items()}
        # time.perf_counter() once the request was all written to the replica (None: unknown).
        self.sent_s = response.sent_s if isinstance(response, _StampedResponse) else None
        self._first: bytes | None = None  # read ahead by `read_first`, for `chunks` to yield first

    @property
    def is_event_stream(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")

    async def read_first(self) -> None:
        """Read the body's first piece now (b"": the body is empty); `chunks` yields it first.
        Raises UpstreamError if the body breaks off before it."""
        try:
            self._first = await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _translate(e) from e

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes in the pieces they arrive in; raises UpstreamError if it breaks off."""
        if self._first is not None:
            first, self._first = self._first, None
            if not first:
                return
            yield first
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _translate(e) from e

    async def read(self) -> bytes:
        """The whole body; raises UpstreamError if it breaks off."""
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _translate(e) from e

    def close(self, complete: bool) -> None:
        """Give the connection back for reuse when the body was read to the end; drop it otherwise,
        so the replica sees the client leave and aborts the request."""
        if complete:
            self._response.release()
        else:
            self._response.close()


@dataclass(frozen=True, slots=True)
class Fetched:
    """A small response read whole; header names lower-cased."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    max_connections: int
    connect_timeout_s: float
    read_timeout_s: float  # for the first byte, and between any two reads after it
    # The same for a non-streamed request, whose first byte comes with the whole answer (None: none).
    response_timeout_s: float | None = None
    keepalive_s: float = 4.0  # below uvicorn's 5 s, so a replica never closes a connection under us


class Upstream:
    """One shared session; open with `async with`."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._eager: eager_start.EagerStart | None = None
        # A request's timeouts: streamed (the session's own), and not streamed.
        self._timeouts: dict[bool, aiohttp.ClientTimeout] = {}

    async def __aenter__(self) -> Upstream:
        config = self.config
        if sys.version_info < (3, 12):
            # aiohttp writes a body in a task that would first run a loop turn later.
            self._eager = eager_start.install(
                asyncio.get_running_loop(), [_StampedRequest.write_bytes.__code__]
            )
        connector = aiohttp.TCPConnector(
            limit=config.max_connections, limit_per_host=0, keepalive_timeout=config.keepalive_s
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=config.connect_timeout_s + _POOL_WAIT_S,
            sock_connect=config.connect_timeout_s,
            sock_read=config.read_timeout_s,
        )
        self._timeouts = {
            True: timeout,
            False: aiohttp.ClientTimeout(
                total=None,
                connect=config.connect_timeout_s + _POOL_WAIT_S,
                sock_connect=config.connect_timeout_s,
                sock_read=config.response_timeout_s,
            ),
        }
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            read_bufsize=_CHUNK_LIMIT,
            request_class=_StampedRequest,
            response_class=_StampedResponse,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        eager_start.uninstall(asyncio.get_running_loop(), self._eager)
        self._eager = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the upstream client is not open")
        return self._session

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], is_stream: bool = True
    ) -> UpstreamResponse:
        """Send `body` and wait for the response head (not the body); a request that is not
        streamed (`is_stream` False) waits up to `response_timeout_s` for it."""
        timeout = self._timeouts[is_stream]
        try:
            response = await self.session.post(
                url, data=body, headers=headers, allow_redirects=False, timeout=timeout
            )
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _translate(e) from e
        return UpstreamResponse(response)

    async def get(self, url: str, timeout_s: float, headers: dict[str, str] | None = None) -> Fetched:
        """A small GET (metrics, health, the model list), read whole."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.get(
                url, timeout=timeout, headers=headers, allow_redirects=False
            ) as response:
                received = {k.lower(): v for k, v in response.headers.items()}
                return Fetched(response.status, received, await response.read())
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _translate(e) from e
