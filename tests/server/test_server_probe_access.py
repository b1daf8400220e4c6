"""The engine's access log and the reads probes, scrapers and the gateway repeat all day: a
successful GET/HEAD of /health, /metrics or /v1/models writes no line unless --log-probe-requests
asks for it; a failed one always does."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from corral_engine.server import create_app
from fastapi import FastAPI

from tests.server.fake_engine import FakeEngine

ACCESS_LOGGER = "corral_engine.server.access"
MODEL = FakeEngine.served_model_name


def access_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, int]]:
    records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    return [(r.__dict__["method"], r.__dict__["path"], r.__dict__["status"]) for r in records]


@asynccontextmanager
async def serving(**options: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A client of a running engine app made with these `create_app` options."""
    app = create_app(FakeEngine(), **options)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client, app


async def _probe_everything(client: httpx.AsyncClient) -> None:
    for response in (
        await client.get("/health"),
        await client.head("/health"),
        await client.get("/metrics"),
        await client.get("/v1/models"),
        await client.get(f"/v1/models/{MODEL}"),
    ):
        assert response.status_code == 200


async def test_successful_probes_and_model_lists_write_no_access_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gateway's minute-by-minute GET /v1/models wrote a line per replica per gateway."""
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    async with serving() as (client, _):
        await _probe_everything(client)
        assert access_lines(caplog) == []
        # An API request alongside is still logged, and so is a model read that fails.
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        assert (await client.get("/v1/models/nope")).status_code == 404
    assert access_lines(caplog) == [("POST", "/v1/completions", 200), ("GET", "/v1/models/nope", 404)]


async def test_a_failed_health_probe_writes_an_access_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    async with serving() as (client, app):
        app.state.ctx.is_draining = True
        assert (await client.get("/health")).status_code == 503
        assert (await client.head("/health")).status_code == 503
        app.state.ctx.is_draining = False
    assert access_lines(caplog) == [("GET", "/health", 503), ("HEAD", "/health", 503)]
    [record, _] = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert record.getMessage().startswith("request -: GET /health 503")  # a probe carries no id


async def test_a_model_list_refused_for_its_key_writes_an_access_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    async with serving(api_key="k") as (client, _):
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers={"authorization": "Bearer k"})).status_code == 200
        assert (await client.get("/health")).status_code == 200  # public: no key needed
    assert access_lines(caplog) == [("GET", "/v1/models", 401)]


async def test_log_probe_requests_logs_every_probe(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    async with serving(log_probe_requests=True) as (client, _):
        await _probe_everything(client)
    assert access_lines(caplog) == [
        ("GET", "/health", 200),
        ("HEAD", "/health", 200),
        ("GET", "/metrics", 200),
        ("GET", "/v1/models", 200),
        ("GET", f"/v1/models/{MODEL}", 200),
    ]


async def test_a_probe_gets_no_request_id_header() -> None:
    """Only API requests are named: /health and /metrics answer as before, with no id minted."""
    async with serving() as (client, _):
        assert "x-request-id" not in (await client.get("/health")).headers
        assert "x-request-id" in (await client.get("/v1/models")).headers
