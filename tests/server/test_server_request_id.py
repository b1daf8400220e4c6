"""The engine's request id: a valid incoming x-request-id is adopted for the response id, the
response header and the access log line; anything else is replaced by a minted one."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib

import httpx
import pytest
from corral_cli.main import version
from corral_engine import wire
from corral_engine.demo_model import write_demo_model
from corral_engine.server import create_app
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import Fitted, Profile

from tests.server.asgi_call import AsgiCall
from tests.server.fake_engine import FakeEngine

MODEL = FakeEngine.served_model_name
ACCESS_LOGGER = "corral_engine.server.access"
# A simulated engine taking 1 ms a step: its requests get FINAL_ONLY outputs, as the real engine's.
SIM_PROFILE = Profile("test", Fitted((1e-3, 0.0, 0.0, 0.0, 0.0)), num_kv_blocks=256, max_model_len=1024)


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS_LOGGER]


async def test_incoming_id_names_the_response_and_the_log_line(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "secret prompt"}], "max_tokens": 4}
    r = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "gw-0042.a:b"})
    assert r.status_code == 200, r.text
    assert r.headers[wire.HEADER_REQUEST_ID] == "gw-0042.a:b"
    assert r.json()["id"] == "chatcmpl-gw-0042.a:b"
    [record] = access_records(caplog)
    assert record.__dict__["request_id"] == "gw-0042.a:b"
    assert record.__dict__["status"] == 200
    assert record.__dict__["model"] == MODEL
    assert record.__dict__["completion_tokens"] == 4
    assert record.__dict__["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert record.__dict__["latency_s"] >= 0
    assert "secret prompt" not in caplog.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_streamed_request_is_logged_with_its_tokens(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    body: dict[str, object] = {"model": MODEL, "max_tokens": 5, "stream": True}
    body.update(
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = await client.post(path, json=body, headers={"x-request-id": "s1"})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    [record] = access_records(caplog)
    assert record.__dict__["request_id"] == "s1" and record.__dict__["completion_tokens"] == 5
    assert record.__dict__["prompt_tokens"] > 0


async def test_streamed_chunks_carry_the_incoming_id(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    r = await client.post("/v1/completions", json=body, headers={"x-request-id": "abc123"})
    assert r.headers[wire.HEADER_REQUEST_ID] == "abc123"
    events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    assert events and {e["id"] for e in events} == {"cmpl-abc123"}


@pytest.mark.parametrize("incoming", [None, "", "has space", "x" * 129, "a/b", "{bad}"])
async def test_missing_or_invalid_id_is_replaced_by_a_minted_one(
    client: httpx.AsyncClient, incoming: str | None
) -> None:
    headers = {} if incoming is None else {"x-request-id": incoming}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = await client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    minted = r.headers[wire.HEADER_REQUEST_ID]
    assert minted != incoming and wire.valid_request_id(minted) == minted
    assert r.json()["id"] == f"cmpl-{minted}"


async def test_refused_request_is_logged_with_its_status_and_id(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    r = await client.post(
        "/v1/completions", json={"model": "nope", "prompt": "hi"}, headers={"x-request-id": "r1"}
    )
    assert r.status_code == 404
    assert r.headers[wire.HEADER_REQUEST_ID] == "r1"
    [record] = access_records(caplog)
    assert (record.__dict__["request_id"], record.__dict__["status"]) == ("r1", 404)


async def test_probes_are_not_access_logged(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    await client.get("/health")
    await client.get("/metrics")
    assert access_records(caplog) == []


def test_request_id_rule() -> None:
    assert wire.valid_request_id("A-z_0.9:x") == "A-z_0.9:x"
    assert wire.valid_request_id("x" * wire.MAX_REQUEST_ID_CHARS) is not None
    for bad in (None, "", "a b", "x" * (wire.MAX_REQUEST_ID_CHARS + 1), "a/b", "a\r\nb"):
        assert wire.valid_request_id(bad) is None


async def test_version_route(client: httpx.AsyncClient) -> None:
    r = await client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": version()}


async def test_a_reused_id_of_a_running_request_is_still_served(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.gate.clear()  # the first request waits in the queue, its id in use
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    first = asyncio.create_task(client.post("/v1/completions", json=body, headers={"x-request-id": "same"}))
    while "cmpl-same" not in engine.requests:
        await asyncio.sleep(0.01)
    second = asyncio.create_task(client.post("/v1/completions", json=body, headers={"x-request-id": "same"}))
    while len(engine.requests) < 2:
        await asyncio.sleep(0.01)
    engine.gate.set()
    for response in await asyncio.gather(first, second):
        assert response.status_code == 200, response.text
        assert response.json()["id"] == "cmpl-same" and response.headers["x-request-id"] == "same"


@pytest.mark.parametrize("incoming", ["r-err", None])
async def test_an_internal_error_is_logged_with_the_request_id(
    client: httpx.AsyncClient,
    engine: FakeEngine,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    incoming: str | None,
) -> None:
    """The traceback of a 500 names the request, so the gateway's access line (same id) leads to it."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "add_request", broken)
    caplog.set_level(logging.INFO)
    headers = {wire.HEADER_REQUEST_ID: incoming} if incoming else {}
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers)
    assert r.status_code == 500
    request_id = r.headers[wire.HEADER_REQUEST_ID]
    assert incoming is None or request_id == incoming
    [error] = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
    assert error.exc_info is not None
    assert error.__dict__["request_id"] == request_id
    assert request_id in error.getMessage()
    [access_line] = access_records(caplog)
    assert access_line.__dict__["request_id"] == request_id


async def test_a_client_leaving_mid_stream_is_logged_with_the_request_id(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(engine)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "stream": True}
    call = AsgiCall(app, body, headers=[(wire.HEADER_REQUEST_ID.encode(), b"left-1")])
    caplog.set_level(logging.INFO)
    async with app.router.lifespan_context(app):
        task = asyncio.create_task(call.run("/v1/completions"))
        while not any(m.get("body") for m in call.sent if m["type"] == "http.response.body"):
            await asyncio.sleep(0.001)
        call.hang_up.set()
        await asyncio.wait_for(task, 10)
    lines = [r for r in caplog.records if r.name != ACCESS_LOGGER and "left-1" in r.getMessage()]
    assert {r.getMessage().split(":")[-1].strip() for r in lines} >= {"client disconnected mid-stream"}
    assert lines and all(r.__dict__.get("request_id") == "left-1" for r in lines)


async def test_a_stream_whose_client_left_is_logged_with_the_tokens_it_used(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The access line (and the span's usage) count what the engine computed for a request
    aborted by its client leaving, as the engine's token counters do: they said 0 + 0, since the
    abort's last output comes after the request's streams are closed."""
    app = create_app(engine)
    body = {"model": MODEL, "prompt": "hi there", "max_tokens": 200, "stream": True, "ignore_eos": True}
    call = AsgiCall(app, body, headers=[(wire.HEADER_REQUEST_ID.encode(), b"left-2")])
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    async with app.router.lifespan_context(app):
        task = asyncio.create_task(call.run("/v1/completions"))
        while engine.stats().num_generation_tokens_total < 3:
            assert not task.done(), call.sent
            await asyncio.sleep(0.001)
        call.hang_up.set()
        await asyncio.wait_for(task, 10)
    [record] = access_records(caplog)
    assert record.__dict__["prompt_tokens"] == len(engine.tokenizer.encode("hi there"))
    assert 3 <= record.__dict__["completion_tokens"] < 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
async def test_a_whole_response_whose_client_left_is_logged_with_the_tokens_it_used(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """A request that is not streamed has no output before its last (vLLM's FINAL_ONLY, as the
    simulator's engine gives it): its access line said 0 + 0 when its client left; the aborted
    request's final output says what it had computed."""
    model_dir = write_demo_model(tmp_path / "sim", arch="mistral", weights=False)
    [engine] = build_engines(ReplicaSpec(SIM_PROFILE, model_dir, "sim"), 1)
    app = create_app(engine)
    asks: dict[str, dict[str, object]] = {
        "/v1/completions": {"prompt": "hi there", "max_tokens": 900, "ignore_eos": True},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900},
        "/v1/responses": {"input": "hi", "max_output_tokens": 900},
    }
    body = {"model": "sim", **asks[path]}
    call = AsgiCall(app, body, headers=[(wire.HEADER_REQUEST_ID.encode(), b"left-3")])
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    async with app.router.lifespan_context(app):
        task = asyncio.create_task(call.run(path))
        while engine.stats().num_generation_tokens_total < 3:
            assert not task.done(), call.sent
            await asyncio.sleep(0.001)
        call.hang_up.set()
        await asyncio.wait_for(task, 10)
    assert call.sent[0]["status"] == 499
    [record] = access_records(caplog)
    assert record.__dict__["prompt_tokens"] > 0
    assert 3 <= record.__dict__["completion_tokens"] < 900
