"""A traced request through a real gateway and engine arrives at a real OpenTelemetry Collector as
one trace with linked spans, and the request id is the same in the client's response, both JSON
logs and the trace (issue 26, acceptance 1).

The collector is built from the Go module proxy (e2e/otel/build.sh) and forwards what it receives
as OTLP JSON to a sink in this process. The client starts the trace (its own `traceparent`); the
gateway mints the request id.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.otel.collector import Span, SpanSink, collector_binary, running_collector
from e2e.procs import HOST, ManagedProcess, free_port, start_engine

pytestmark = [pytest.mark.e2e]

MODEL = "tiny-llama"
SERVER, CLIENT = 2, 3  # OTLP SpanKind
# Export every 100 ms instead of every 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SpanSink]]:
    binary = collector_binary()
    with running_collector(binary, tmp_path_factory.mktemp("otelcol")) as running:
        yield running


def _access_lines(log_path: Path, logger: str) -> list[dict[str, object]]:
    """The access lines of chat requests (an engine logs a read of its /v1/models only when it
    fails; the gateway's own lines, all of proxied requests, name no path)."""
    lines = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if (
                record.get("logger") == logger
                and record.get("path", "/v1/chat/completions") == "/v1/chat/completions"
            ):
                lines.append(record)
    return lines


def _one(spans: list[Span], service: str, name: str) -> Span:
    (span,) = [s for s in spans if s.service == service and s.name == name]
    return span


def test_one_trace_with_linked_spans_and_one_request_id(
    collector: tuple[str, SpanSink], tiny_model_dir: Path, tmp_path: Path
) -> None:
    endpoint, sink = collector
    traced = {"otlp_traces_endpoint": endpoint, "log_format": "json"}
    with start_engine(
        tiny_model_dir, served_model_name=MODEL, num_threads=1, log_dir=tmp_path, env=FAST_EXPORT, **traced
    ) as engine:
        port = free_port()
        argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", HOST, "--port", str(port)]
        argv += [
            "--backend",
            f"{MODEL}={engine.url}",
            "--otlp-traces-endpoint",
            endpoint,
            "--log-format",
            "json",
        ]
        with ManagedProcess(argv, port, name="gateway", log_dir=tmp_path, env=FAST_EXPORT) as gateway:
            gateway.wait_ready(60)
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
            headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
            r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            request_id = r.headers["x-request-id"]
            names = {"POST /v1/chat/completions", "queue", "upstream", f"chat {MODEL}", "prefill", "decode"}
            spans = [s for s in sink.wait_for(names) if s.trace_id == trace_id]
        gateway_log, engine_log = gateway.log_path, engine.log_path

    # One request id: the response's header and id, both access lines, both server spans.
    assert r.json()["id"] == f"chatcmpl-{request_id}"
    (gateway_line,) = _access_lines(gateway_log, "corral_gateway.access")
    (engine_line,) = _access_lines(engine_log, "corral_engine.server.access")
    assert gateway_line["request_id"] == engine_line["request_id"] == request_id
    assert (gateway_line["status"], engine_line["status"]) == ("200", 200)
    assert gateway_line["replica"] == engine.url and engine_line["completion_tokens"] == 6

    # One trace, linked: client -> gateway server -> queue, upstream -> engine server -> phases.
    server = _one(spans, "corral-gateway", "POST /v1/chat/completions")
    queue = _one(spans, "corral-gateway", "queue")
    upstream = _one(spans, "corral-gateway", "upstream")
    engine_span = _one(spans, "corral-engine", f"chat {MODEL}")
    assert (server.kind, upstream.kind, engine_span.kind) == (SERVER, CLIENT, SERVER)
    assert server.parent_span_id == client_span
    assert queue.parent_span_id == upstream.parent_span_id == server.span_id
    assert engine_span.parent_span_id == upstream.span_id
    for phase in ("queue", "prefill", "decode"):
        assert _one(spans, "corral-engine", phase).parent_span_id == engine_span.span_id, phase
    assert server.attributes["gen_ai.request.id"] == engine_span.attributes["gen_ai.request.id"] == request_id
    assert queue.attributes["corral.replica"] == engine.url
    assert engine_span.attributes["gen_ai.usage.output_tokens"] == 6
    assert engine_span.attributes["gen_ai.request.model"] == MODEL


def test_a_simulated_replica_sends_the_engines_spans(
    collector: tuple[str, SpanSink], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`corral engine --simulate` traces as the engine does: its server span and phases reach the
    collector (a simulated fleet's traces were silently off)."""
    endpoint, sink = collector
    with start_engine(
        tiny_model_dir,
        simulate="h100-llama3-8b",
        served_model_name=MODEL,
        log_dir=tmp_path,
        env=FAST_EXPORT,
        otlp_traces_endpoint=endpoint,
    ) as engine:
        trace_id = secrets.token_hex(16)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        r = httpx.post(engine.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        names = {f"chat {MODEL}", "prefill", "decode"}
        spans = [s for s in sink.wait_for(names, trace_id=trace_id) if s.trace_id == trace_id]
    engine_span = _one(spans, "corral-engine", f"chat {MODEL}")
    assert engine_span.attributes["server.port"] == int(engine.url.rsplit(":", 1)[1])
    assert engine_span.attributes["gen_ai.usage.output_tokens"] == 4
    for phase in ("prefill", "decode"):
        assert _one(spans, "corral-engine", phase).parent_span_id == engine_span.span_id, phase
