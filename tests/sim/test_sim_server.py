"""A simulated replica behind the real engine server reads like a real one: the OpenAI routes, the
load headers the gateway parses, and every engine metric the dashboards query. No torch."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from corral_cli.chartgen.queries import dashboard_queries, metric_names
from corral_engine import wire
from corral_engine.server import create_app
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import BUILTIN
from corral_gateway.load import parse_load_headers, parse_metrics_text
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture
async def client(tiny_model_dir: pathlib.Path) -> AsyncIterator[httpx.AsyncClient]:
    [engine] = build_engines(ReplicaSpec(BUILTIN["h100-llama3-8b"], tiny_model_dir, "sim"), 1)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            yield c


async def test_chat_streams_and_every_response_carries_load_headers(client: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        sample = parse_load_headers(r.headers, time.monotonic())
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert sample is not None and sample.num_running >= 0
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text  # tokens from the prompt, detokenized by the real output processor
    r = await client.post(
        "/v1/completions", json={"model": "sim", "prompt": "one two three", "max_tokens": 5}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    r = await client.post("/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_a_stream_interval_sends_fewer_events_and_the_same_text(tiny_model_dir: pathlib.Path) -> None:
    body = {"model": "sim", "prompt": "one two three four", "max_tokens": 10, "stream": True}
    seen = {}
    for interval in (1, 4):
        spec = ReplicaSpec(BUILTIN["h100-llama3-8b"], tiny_model_dir, "sim", stream_interval=interval)
        [engine] = build_engines(spec, 1)
        app = create_app(engine)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with (
                httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c,
                c.stream("POST", "/v1/completions", json=body) as r,
            ):
                assert r.status_code == 200
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                metrics = _histograms((await c.get("/metrics")).text)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
        text = "".join(c["text"] for c in chunks)
        seen[interval] = (len(chunks), text)
        # Every token's own gap, taken at its step, however few events carried them.
        itl_count, itl_sum = metrics["vllm:inter_token_latency_seconds"]
        assert itl_count == 9 and metrics["vllm:time_to_first_token_seconds"][0] == 1
        assert itl_sum == pytest.approx(metrics["vllm:request_decode_time_seconds"][1])
    assert seen[1][0] == 10 and seen[4][0] == 4  # tokens 1, 5, 9 and 10 (the last)
    assert seen[4][1] == seen[1][1] and seen[1][1]


def _histograms(text: str) -> dict[str, tuple[float, float]]:
    """family name -> (count, sum) of its one series."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            values = {s.name: s.value for s in family.samples}
            out[family.name] = (values[family.name + "_count"], values[family.name + "_sum"])
    return out


async def test_metrics_hold_what_the_gateway_and_the_dashboards_read(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": "sim", "prompt": "a b c d", "max_tokens": 4})
    assert r.status_code == 200
    text = (await client.get("/metrics")).text
    assert parse_metrics_text(text, time.monotonic()) is not None
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
    queried = set().union(*(metric_names(q.expr) for q in dashboard_queries()))
    # A series per draft position comes only with --speculative, which a simulated replica ignores.
    queried.discard(wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL)
    # The LoRA gauge comes only with --enable-lora (tests/sim/test_sim_lora.py reads it there).
    queried.discard(wire.LORA_REQUESTS_INFO)
    for name in sorted(n for n in queried if n.startswith("vllm:")):
        assert any(e == name or e.startswith(name + "_") for e in exported), name
    ttft_count = next(
        line for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds_count")
    )
    assert float(ttft_count.rsplit(" ", 1)[1]) == 1.0


async def test_a_simulated_n_3_request_counts_as_three_requests(client: httpx.AsyncClient) -> None:
    """As the real engine (vLLM v1's child requests): the success counter and the per-request
    histograms agree."""
    body = {"model": "sim", "prompt": "a b c d", "max_tokens": 4, "n": 3, "ignore_eos": True}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    samples = {
        (s.name, s.labels.get("finished_reason", "")): s.value
        for family in text_string_to_metric_families((await client.get("/metrics")).text)
        for s in family.samples
    }
    assert samples[("vllm:request_success_total", "length")] == 3
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_generation_tokens"):
        assert samples[(f"vllm:{name}_count", "")] == 3, name
    assert samples[("vllm:request_generation_tokens_sum", "")] == 12


def test_the_simulated_path_imports_no_torch(tiny_model_dir: pathlib.Path) -> None:
    code = f"""
import asyncio, pathlib, sys
import corral_cli.simulate
from corral_engine.server import create_app
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import BUILTIN
from corral_engine.sampling_params import SamplingParams

async def main():
    spec = ReplicaSpec(BUILTIN["h100-llama3-8b"], pathlib.Path({str(tiny_model_dir)!r}), "sim")
    engines = build_engines(spec, 64)
    apps = [create_app(e) for e in engines]
    for e in engines:
        await e.start()
    async for out in engines[0].add_request("r", "hello world", SamplingParams(max_tokens=3)):
        pass
    for e in engines:
        await e.shutdown()

asyncio.run(main())
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


async def test_tool_choice_auto_needs_the_parser_the_cli_passes_on(tiny_model_dir: pathlib.Path) -> None:
    import argparse

    from corral_cli.simulate import replica_spec
    from corral_engine.args import EngineArgs

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": tools}
    for parser, status in ((None, 400), ("hermes", 200)):
        args = argparse.Namespace(simulate="h100-llama3-8b")
        spec = replica_spec(args, EngineArgs(model=str(tiny_model_dir), tool_call_parser=parser))
        assert spec.tool_call_parser == parser and spec.served_model_name == tiny_model_dir.name
        [engine] = build_engines(spec, 1)
        app = create_app(engine, tool_call_parser=spec.tool_call_parser)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                r = await c.post("/v1/chat/completions", json={**body, "model": spec.served_model_name})
        assert r.status_code == status, r.text
