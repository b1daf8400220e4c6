"""A large body is read (peeked at, renamed for an alias) off the gateway's event loop: a 32 MiB
conversation must not hold other clients' streams and /health while it is read."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest
from corral_gateway import proxy
from corral_gateway.app import create_app
from corral_gateway.peek import RequestInfo
from corral_gateway.settings import GatewaySettings

MANY_MESSAGES = [{"role": "user", "content": "hi"}] * (proxy.OFF_LOOP_BODY_BYTES // 16)


async def test_a_large_body_is_read_while_the_gateway_answers_others(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    reading, health_answered = threading.Event(), threading.Event()
    peek_request = proxy.peek_request

    def held(*args: Any, **kwargs: Any) -> RequestInfo:
        # The read finishes only once /health has been answered: on the event loop, /health
        # could not be (the wait would run out first and the order below would be reversed).
        reading.set()
        health_answered.wait(timeout=10)
        order.append(f"read on the loop: {threading.current_thread() is threading.main_thread()}")
        return peek_request(*args, **kwargs)

    monkeypatch.setattr(proxy, "peek_request", held)
    app = create_app(GatewaySettings(backends={"m": ["http://127.0.0.1:9"]}))
    body = json.dumps({"model": "nope", "messages": MANY_MESSAGES}).encode()
    assert len(body) > proxy.OFF_LOOP_BODY_BYTES
    async with app.api.router.lifespan_context(app.api):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            post = asyncio.create_task(client.post("/v1/chat/completions", content=body))
            while not reading.is_set() and not post.done():
                await asyncio.sleep(0.01)
            await client.get("/health")
            order.append("health answered")
            health_answered.set()
            response = await post
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert order == ["health answered", "read on the loop: False"]
