"""The gateway's spans (fake replicas on 127.0.0.1): a server span continuing the client's trace,
the queue/pick span with the policy's scores, one upstream span per attempt, and the upstream
span's context sent to the replica in `traceparent`, so the engine's spans join the trace."""

from __future__ import annotations

import pytest
from corral_gateway import tracing
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import fleet
from tests.tracing_capture import capture_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """The module's tracer on a private SDK provider (the process-wide one stays the no-op)."""
    return capture_spans(monkeypatch, tracing)


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def hex_id(span_id: int) -> str:
    return format(span_id, "016x")


async def test_one_trace_from_client_through_gateway_to_replica(spans: InMemorySpanExporter) -> None:
    engine = FakeEngine()
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "req-9"}
    async with fleet([engine]) as (client, urls):
        r = await client.post("/v1/chat/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert r.status_code == 200
    (server,) = named(spans, "POST /v1/chat/completions")
    (queue,) = named(spans, "queue")
    (upstream,) = named(spans, "upstream")
    assert server.kind == SpanKind.SERVER and upstream.kind == SpanKind.CLIENT
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and hex_id(server.parent.span_id) == CLIENT_SPAN
    for child in (queue, upstream):
        assert child.parent is not None and child.parent.span_id == server.context.span_id
    attributes = dict(server.attributes or {})
    assert attributes["gen_ai.request.id"] == "req-9" and attributes["corral.replica"] == urls[0]
    assert attributes["http.response.status_code"] == 200
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (3, 5)
    sent = dict(upstream.attributes or {})
    host, port = urls[0].removeprefix("http://").split(":")
    assert (sent["server.address"], sent["server.port"], sent["url.full"]) == (host, int(port), urls[0])
    pick = dict(queue.attributes or {})
    assert pick["corral.replica"] == urls[0] and pick["corral.policy"] == "prefix-affinity"
    assert [s.split("=")[0] for s in pick["corral.replica_scores"]] == [urls[0]]  # type: ignore[union-attr]
    assert dict(upstream.attributes or {})["http.response.status_code"] == 200
    # The replica got the upstream span's context: its spans are children of the attempt.
    sent = engine.headers_seen[0]["traceparent"]
    assert sent == f"00-{TRACE_ID}-{hex_id(upstream.context.span_id)}-01"


async def test_a_failed_attempt_is_its_own_span(spans: InMemorySpanExporter) -> None:
    engines = [FakeEngine(name="good"), FakeEngine(name="bad", mode="error500")]
    async with fleet(engines, policy="round-robin") as (client, _):
        for _ in range(4):  # round-robin: some requests try the failing replica first
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200 and r.json()["served_by"] == "good"
    attempts = named(spans, "upstream")
    failed = [s for s in attempts if s.status.status_code == StatusCode.ERROR]
    assert failed and len(attempts) == 4 + len(failed)
    for span in failed:
        attributes = dict(span.attributes or {})
        assert (attributes["corral.retry_reason"], attributes["http.response.status_code"]) == (
            "http_500",
            500,
        )
    assert len(named(spans, "queue")) == len(attempts)  # one pick per attempt


async def test_refused_requests_end_their_span(spans: InMemorySpanExporter) -> None:
    async with fleet([FakeEngine()]) as (client, _):
        assert (
            await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        ).status_code == 404
    (server,) = spans.get_finished_spans()
    assert dict(server.attributes or {})["http.response.status_code"] == 404


async def test_no_provider_no_traceparent() -> None:
    engine = FakeEngine()
    async with fleet([engine]) as (client, _):
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status_code == 200
    assert "traceparent" not in engine.headers_seen[0]


async def test_without_a_provider_the_clients_trace_context_reaches_the_replica() -> None:
    """A gateway that does not trace still passes the client's context on, so an engine that traces
    continues the client's trace instead of starting one of its own."""
    engine = FakeEngine()
    headers = {
        "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
        "tracestate": "vendor=abc",
        "baggage": "tenant=t1",
    }
    async with fleet([engine]) as (client, _):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert r.status_code == 200
    sent = engine.headers_seen[0]
    assert {name: sent.get(name) for name in headers} == headers


async def test_a_tracing_gateway_sends_its_attempts_context_and_keeps_the_clients_state(
    spans: InMemorySpanExporter,
) -> None:
    engine = FakeEngine()
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=abc"}
    async with fleet([engine]) as (client, _):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
    assert r.status_code == 200
    (upstream,) = named(spans, "upstream")
    sent = engine.headers_seen[0]
    assert sent["traceparent"] == f"00-{TRACE_ID}-{hex_id(upstream.context.span_id)}-01"
    assert sent["tracestate"] == "vendor=abc"


async def test_scrapes_and_probes_make_no_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a provider installed (--otlp-traces-endpoint), FastAPI 0.16x would trace every route
    of its own: each Prometheus scrape and probe was a trace. Only proxied requests are traced."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    async with fleet([FakeEngine()]) as (client, _):
        for path in ("/metrics", "/health"):
            assert (await client.get(path)).status_code == 200, path
    assert exporter.get_finished_spans() == ()
