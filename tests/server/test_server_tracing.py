"""The engine's spans: a server span continuing the caller's W3C trace, queue/prefill/decode
children from the engine's timestamps, GenAI attributes; nothing at all without a tracer provider."""

from __future__ import annotations

import httpx
import pytest
from corral_engine.server import create_app, tracing
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.server.fake_engine import FakeEngine
from tests.tracing_capture import capture_spans

MODEL = FakeEngine.served_model_name
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """The module's tracer on a private SDK provider (the process-wide one stays the no-op)."""
    return capture_spans(monkeypatch, tracing)


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in finished}


async def test_request_span_continues_the_callers_trace(
    client: httpx.AsyncClient, spans: InMemorySpanExporter
) -> None:
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "gw-1"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    got = by_name(spans.get_finished_spans())
    server = got[f"chat {MODEL}"]
    assert server.kind == SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_ID
    attributes = dict(server.attributes or {})
    assert attributes["gen_ai.request.id"] == "gw-1"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.usage.output_tokens"] == 4
    assert attributes["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.latency.time_to_first_token"] >= 0
    for phase in ("queue", "prefill", "decode"):
        child = got[phase]
        assert child.parent is not None and child.parent.span_id == server.context.span_id, phase
        assert child.context.trace_id == server.context.trace_id
        assert server.start_time is not None and child.start_time is not None
        assert child.end_time is not None and child.start_time <= child.end_time
    assert got["queue"].end_time <= got["prefill"].start_time  # type: ignore[operator]
    assert got["prefill"].end_time <= got["decode"].start_time  # type: ignore[operator]


async def test_without_traceparent_a_new_trace_starts(
    client: httpx.AsyncClient, spans: InMemorySpanExporter
) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    server = by_name(spans.get_finished_spans())[f"text_completion {MODEL}"]
    assert server.parent is None
    assert dict(server.attributes or {})["gen_ai.request.id"] == r.headers["x-request-id"]


async def test_refused_request_span_has_its_status(
    client: httpx.AsyncClient, spans: InMemorySpanExporter
) -> None:
    r = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404
    (server,) = spans.get_finished_spans()
    assert dict(server.attributes or {})["http.response.status_code"] == 404


async def test_no_provider_no_spans(client: httpx.AsyncClient) -> None:
    assert not tracing.is_enabled()  # the process-wide provider is the API's no-op
    assert tracing.start_request_span({}, "POST", "/v1/completions", MODEL) is None
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


async def test_a_request_that_is_not_a_generation_is_a_plain_http_span(
    client: httpx.AsyncClient, spans: InMemorySpanExporter
) -> None:
    """The model list (a gateway reads it from every replica each minute) must not look like a call
    of the model, with zero tokens, to a GenAI tracing backend."""
    r = await client.get("/v1/models", headers={"x-request-id": "list-1"})
    assert r.status_code == 200
    (server,) = spans.get_finished_spans()
    assert server.name == "GET /v1/models" and server.kind == SpanKind.SERVER
    attributes = dict(server.attributes or {})
    assert attributes["http.request.method"] == "GET"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.request.id"] == "list-1"
    assert not {"gen_ai.operation.name", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"} & set(
        attributes
    )


async def test_the_span_says_which_replica_served_and_the_genai_request_and_response(
    engine: FakeEngine, spans: InMemorySpanExporter
) -> None:
    """Several replicas share one service name: the address and port the request came in on tell
    them apart. The GenAI conventions' request parameters, response id and finish reasons (vLLM
    sets most of them) are on the span too."""
    app = create_app(engine)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "n": 2}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)  # the scope's server: the URL's host and port
        async with httpx.AsyncClient(transport=transport, base_url="http://10.1.2.3:8123") as client:
            headers = {"x-request-id": "r-1"}
            r = await client.post("/v1/completions", json={**body, "seed": 7}, headers=headers)
    assert r.status_code == 200, r.text
    attributes = dict(by_name(spans.get_finished_spans())[f"text_completion {MODEL}"].attributes or {})
    assert (attributes["server.address"], attributes["server.port"]) == ("10.1.2.3", 8123)
    assert attributes["gen_ai.response.id"] == r.json()["id"] == "cmpl-r-1"
    assert attributes["gen_ai.request.max_tokens"] == 3
    assert attributes["gen_ai.request.temperature"] == 0.5 and attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.seed"] == 7 and attributes["gen_ai.request.choice.count"] == 2
    assert attributes["gen_ai.response.finish_reasons"] == ("length", "length")
    assert "gen_ai.request.top_k" not in attributes  # not set: top-k off
