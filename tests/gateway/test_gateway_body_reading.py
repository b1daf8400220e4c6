"""What the gateway reads of a request's body before refusing it: nothing, for a client without
an API key or one whose declared length is over the limit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from corral_gateway.app import create_app
from corral_gateway.settings import GatewaySettings

from tests.server.asgi_call import post_scope


class Upload:
    """An ASGI client sending 1 MiB chunks that never end, counting those the server read."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        self.num_read = 0
        self.sent: list[dict[str, Any]] = []
        self.response_headers: dict[bytes, bytes] = {}

    async def receive(self) -> dict[str, Any]:
        self.num_read += 1
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": True}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def post(self, app: Any, path: str) -> tuple[int, dict[str, Any]]:
        await app(post_scope(path, self.headers), self.receive, self.send)
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        self.response_headers = dict(self.sent[0]["headers"])
        return int(self.sent[0]["status"]), json.loads(body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/tokenize"])
async def test_refused_before_the_body_is_read(tmp_path: Path, path: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-good\n")
    settings = GatewaySettings(
        backends={"m": ["http://127.0.0.1:9"]}, api_keys_file=keys, max_request_bytes=1 << 20
    )
    app = create_app(settings)
    async with app.api.router.lifespan_context(app.api):
        for headers in [{}, {"authorization": "Bearer sk-wrong"}]:
            anonymous = Upload(headers)
            status, body = await anonymous.post(app, path)
            assert (status, body["error"]["code"]) == (401, "invalid_api_key")
            assert anonymous.num_read == 0
            assert anonymous.response_headers[b"www-authenticate"] == b"Bearer"
        oversized = Upload({"authorization": "Bearer sk-good", "content-length": str(64 << 20)})
        status, _ = await oversized.post(app, path)
        assert status == 413 and oversized.num_read == 0
