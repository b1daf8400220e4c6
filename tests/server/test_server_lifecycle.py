"""Client hang-ups abort engine requests; metrics parse and carry vLLM's names; health and drain."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
import pytest
import uvicorn
from corral_engine import wire
from corral_engine.outputs import EngineStats
from corral_engine.server import create_app, lifecycle
from corral_engine.server.lifecycle import DrainingServer, missing_fast_http, throughput_line
from prometheus_client.parser import text_string_to_metric_families

from tests.server.asgi_call import AsgiCall
from tests.server.fake_engine import FakeEngine

MODEL = FakeEngine.served_model_name

LISTED_METRICS = [
    wire.NUM_REQUESTS_RUNNING,
    wire.NUM_REQUESTS_WAITING,
    wire.KV_CACHE_USAGE_PERC,
    wire.CACHE_CONFIG_INFO,
    wire.NUM_PREEMPTIONS_TOTAL,
    wire.PROMPT_TOKENS_TOTAL,
    wire.GENERATION_TOKENS_TOTAL,
    wire.REQUEST_SUCCESS_TOTAL,
    wire.PREFIX_CACHE_QUERIES_TOTAL,
    wire.PREFIX_CACHE_HITS_TOTAL,
    wire.TIME_TO_FIRST_TOKEN_SECONDS,
    wire.INTER_TOKEN_LATENCY_SECONDS,
    wire.E2E_REQUEST_LATENCY_SECONDS,
    wire.REQUEST_QUEUE_TIME_SECONDS,
    wire.REQUEST_PROMPT_TOKENS,
    wire.REQUEST_GENERATION_TOKENS,
    wire.REQUEST_PREFILL_KV_COMPUTED_TOKENS,
    wire.REQUEST_PARAMS_MAX_TOKENS,
    wire.REQUEST_PARAMS_N,
    wire.REQUEST_MAX_NUM_GENERATION_TOKENS,
    wire.SPEC_DECODE_NUM_DRAFTS_TOTAL,
    wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL,
    wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL,
]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_parse_and_list_every_vllm_metric(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 6}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    names = {name for name, _ in got}
    engine, model = (wire.ENGINE_LABEL, "0"), (wire.MODEL_NAME_LABEL, MODEL)
    for metric in LISTED_METRICS:
        base = metric.removesuffix("_total")
        assert names & {metric, base + "_total", base + "_count"}, metric
    assert got[(wire.GENERATION_TOKENS_TOTAL, (engine, model))] == 6
    assert got[(wire.PROMPT_TOKENS_TOTAL, (engine, model))] == 6
    assert got[(wire.REQUEST_SUCCESS_TOTAL, (engine, ("finished_reason", "length"), model))] == 1
    info = (("block_size", "16"), ("cache_dtype", "auto"), engine, model, ("num_gpu_blocks", "64"))
    assert got[(wire.CACHE_CONFIG_INFO, info)] == 1
    assert got[(wire.TIME_TO_FIRST_TOKEN_SECONDS + "_count", (engine, model))] == 1
    assert got[(wire.INTER_TOKEN_LATENCY_SECONDS + "_count", (engine, model))] == 5
    assert got[(wire.REQUEST_GENERATION_TOKENS + "_sum", (engine, model))] == 6
    assert got[(wire.REQUEST_PARAMS_MAX_TOKENS + "_sum", (engine, model))] == 6
    assert got[(wire.REQUEST_PARAMS_N + "_sum", (engine, model))] == 1
    assert got[(wire.NUM_REQUESTS_RUNNING, (engine, model))] == 0


async def test_waiting_gauge_moves_on_enqueue(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.gate.clear()
    task = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}))
    while not engine.requests:
        await asyncio.sleep(0.001)
    got = samples((await client.get("/metrics")).text)
    assert got[(wire.NUM_REQUESTS_WAITING, ((wire.ENGINE_LABEL, "0"), (wire.MODEL_NAME_LABEL, MODEL)))] == 1
    engine.gate.set()
    assert (await task).status_code == 200


async def test_non_streaming_hang_up_aborts_the_request(engine: FakeEngine) -> None:
    """Collected through the response's listener where the engine offers one, else its stream."""
    engine.gate.clear()  # the request waits in the queue
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        call = AsgiCall(app, {"model": MODEL, "prompt": "x", "max_tokens": 50})
        task = asyncio.create_task(call.run("/v1/completions"))
        while not engine.requests:
            await asyncio.sleep(0.001)
        call.hang_up.set()
        await asyncio.wait_for(task, 5)
        engine.gate.set()  # anything the engine still delivers finds the run closed
        await asyncio.sleep(0.02)
    assert len(engine.aborted) == 1 and engine.requests == {}
    assert engine.abort_calls == engine.aborted
    assert app.state.ctx.in_flight.count == 0
    assert engine.listened == int(engine.can_listen)


@pytest.mark.parametrize("prompt", ["a", ["a", "b"]], ids=["one prompt", "two prompts"])
async def test_streaming_hang_up_aborts_every_prompt(engine: FakeEngine, prompt: str | list[str]) -> None:
    """One prompt streams through the response's listener where the engine offers one; several
    are read from their merged streams."""
    num_prompts = 1 if isinstance(prompt, str) else len(prompt)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "stream": True}
        call = AsgiCall(app, body)
        task = asyncio.create_task(call.run("/v1/completions"))
        while sum(m["type"] == "http.response.body" for m in call.sent) < 3:
            await asyncio.sleep(0.001)
        call.hang_up.set()
        await asyncio.wait_for(task, 5)
        sent = len(call.sent)
        await asyncio.sleep(0.02)  # nothing more is written once the client has gone
        assert len(call.sent) == sent
    assert len(engine.aborted) == num_prompts and engine.requests == {}
    assert sorted(engine.abort_calls) == sorted(engine.aborted)
    assert app.state.ctx.in_flight.count == 0
    assert engine.listened == int(engine.can_listen and num_prompts == 1)
    assert call.sent[-1].get("more_body") is True  # no end of body for a gone client
    start = call.sent[0]
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert wire.HEADER_NUM_RUNNING.encode() in headers
    assert b"content-length" not in headers and headers[b"content-type"].startswith(b"text/event-stream")


async def test_health_is_503_before_start_and_while_draining(engine: FakeEngine) -> None:
    app = create_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        assert (await client.get("/health")).status_code == 503
        async with app.router.lifespan_context(app):
            assert (await client.get("/health")).status_code == 200
            app.state.ctx.is_draining = True
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 503


def test_missing_fast_http_names_what_uvicorn_would_fall_back_from(monkeypatch: Any) -> None:
    assert missing_fast_http() == []  # the engine extra installs both
    real = lifecycle.importlib.util.find_spec
    monkeypatch.setattr(
        lifecycle.importlib.util, "find_spec", lambda name: None if name == "httptools" else real(name)
    )
    assert missing_fast_http() == ["httptools"]


def test_throughput_line_reports_rates_and_stays_quiet_when_idle() -> None:
    idle = EngineStats()
    assert throughput_line(idle, EngineStats(), 10.0) is None
    busy = EngineStats(
        num_running=3,
        num_waiting=1,
        kv_usage_ratio=0.25,
        num_prompt_tokens_total=200,
        num_generation_tokens_total=50,
    )
    line = throughput_line(idle, busy, 10.0)
    assert line is not None
    for part in ("prompt 20.0 tok/s", "generation 5.0 tok/s", "running 3", "waiting 1", "KV usage 25.0%"):
        assert part in line


async def test_drain_waits_for_open_requests_and_gives_up_after_the_grace(engine: FakeEngine) -> None:
    app = create_app(engine)
    ctx = app.state.ctx
    patient = DrainingServer(uvicorn.Config(app), ctx, drain_timeout_s=3600)
    assert not await patient.on_tick(1)
    ctx.in_flight.enter()
    patient.handle_exit(signal.SIGTERM, None)
    assert ctx.is_draining
    assert not await patient.on_tick(1)  # a request is still open
    ctx.in_flight.leave()
    assert await patient.on_tick(1)  # drained
    assert not patient.force_exit

    ctx.is_draining = False
    ctx.in_flight.enter()
    impatient = DrainingServer(uvicorn.Config(app), ctx, drain_timeout_s=0)
    impatient.handle_exit(signal.SIGTERM, None)
    assert await impatient.on_tick(1)  # grace over with the request still open
    impatient.handle_exit(signal.SIGTERM, None)
    assert impatient.force_exit
