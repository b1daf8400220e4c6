"""Driving an ASGI app by hand, so a test decides when the client hangs up."""

from __future__ import annotations

import asyncio
import json
from typing import Any


class AsgiCall:
    """Drive the ASGI app by hand so a test decides when the client hangs up."""

    def __init__(
        self, app: Any, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self.app = app
        self.body = json.dumps(body).encode()
        self.headers = headers or []
        self.hang_up = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self._body_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def run(self, path: str) -> None:
        await self.app(post_scope(path, self.headers), self.receive, self.send)


def post_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """The ASGI scope of a JSON POST to `path` from 127.0.0.1, with `headers` after the content type."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
