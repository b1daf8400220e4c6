from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from corral_engine.server import create_app

from tests.server.fake_engine import FakeEngine


@pytest.fixture(params=["stream", "listen"])
def engine(request: pytest.FixtureRequest) -> FakeEngine:
    """Each server test runs against both ways outputs reach a streamed response: read from the
    request's stream, and handed to the response's listener (the real engine's way)."""
    return FakeEngine(can_listen=request.param == "listen")


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            yield c
