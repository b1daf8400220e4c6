"""Bodies over the engine's limit are refused as they arrive, not after being read whole."""

from __future__ import annotations

import json
from typing import Any

import pytest
from corral_engine.server import create_app
from corral_engine.server.context import MAX_BODY_BYTES

from tests.server.asgi_call import post_scope
from tests.server.fake_engine import FakeEngine

CHUNK = b"x" * (1 << 20)


class EndlessUpload:
    """An ASGI client sending 1 MiB chunks, up to four times the limit, counting those read."""

    def __init__(self, declared_length: int | None) -> None:
        self.declared_length = declared_length
        self.num_read = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        self.num_read += 1
        more = self.num_read < 4 * MAX_BODY_BYTES // len(CHUNK)
        return {"type": "http.request", "body": CHUNK, "more_body": more}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def post(self, app: Any, path: str) -> int:
        headers = []
        if self.declared_length is not None:
            headers.append((b"content-length", str(self.declared_length).encode()))
        await app(post_scope(path, headers), self.receive, self.send)
        return int(self.sent[0]["status"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_an_oversized_body_is_refused_before_it_is_read_whole(path: str) -> None:
    app = create_app(FakeEngine())
    async with app.router.lifespan_context(app):
        streamed = EndlessUpload(declared_length=None)  # chunked: no length to go by
        assert await streamed.post(app, path) == 413
        assert streamed.num_read <= MAX_BODY_BYTES // len(CHUNK) + 1
        declared = EndlessUpload(declared_length=4 * MAX_BODY_BYTES)
        assert await declared.post(app, path) == 413
        assert declared.num_read == 0


async def test_the_engine_reads_what_the_gateway_forwards_and_refuses_alike() -> None:
    """The default gateway forwards bodies up to its max_request_bytes; the engine behind it must
    read those (it refused 16 MiB and more while the gateway took 32), and refuse a larger one
    with the gateway's code (it said `code: null`)."""
    from corral_gateway.settings import GatewaySettings

    assert GatewaySettings().max_request_bytes <= MAX_BODY_BYTES
    app = create_app(FakeEngine())
    async with app.router.lifespan_context(app):
        declared = EndlessUpload(declared_length=4 * MAX_BODY_BYTES)
        assert await declared.post(app, "/v1/completions") == 413
    body = json.loads(b"".join(m.get("body", b"") for m in declared.sent))
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
