"""A bound on the size of an HTTP request's head (request line and headers), for the engine's and
the gateway's uvicorn servers.

uvicorn's httptools protocol has none: llhttp hands a header over in pieces and httptools joins
them until the line ends, so one client sending a header with no end made a server hold hundreds
of megabytes (and copy them again at every piece), before any API key was checked. h11, uvicorn's
fallback parser, has a bound of its own (`h11_max_incomplete_event_size`), set to the same value.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

# Go's net/http allows 1 MiB and Node.js 16 KiB; 64 KiB leaves room for large bearer tokens,
# cookies and trace baggage, and bounds a slow client's head at this plus one socket read.
MAX_HEAD_BYTES = 64 * 1024
_LINGER_S = 1.0

_REFUSAL = json.dumps(
    {
        "error": {
            "message": f"The request's line and headers exceed {MAX_HEAD_BYTES} bytes.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_header_fields_too_large",
        }
    }
).encode()


def uvicorn_options() -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config`/`uvicorn.run` bounding a request's head."""
    if importlib.util.find_spec("httptools") is None:
        return {"h11_max_incomplete_event_size": MAX_HEAD_BYTES}
    return {"http": bounded_httptools_protocol()}


def bounded_httptools_protocol() -> type:
    """uvicorn's httptools protocol, answering 431 and closing once a request's head passes
    MAX_HEAD_BYTES (counted per socket read, checked after the parser has seen it)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHeadProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _is_in_head = True  # between the end of one request's body and the next one's headers
        _is_refused = False

        def data_received(self, data: bytes) -> None:
            if self._is_refused:
                return
            if self._is_in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._is_in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._refuse()

        def on_headers_complete(self) -> None:
            self._is_in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._is_in_head, self._head_bytes = True, 0
            super().on_message_complete()

        def _refuse(self) -> None:
            self._is_refused = True
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\n"
                b"content-length: " + str(len(_REFUSAL)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + _REFUSAL
            )
            # Closing with the client's bytes unread would reset the connection, and the client
            # could lose the answer: end the answer, drop what still comes, close a moment later.
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(_LINGER_S, self.transport.close)

    return BoundedHeadProtocol
