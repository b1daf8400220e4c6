"""OpenTelemetry spans of one proxied request: a server span that starts or continues the client's
W3C trace, a `queue` span (waiting for a replica, then the pick, with the policy's scores), and one
`upstream` client span per attempt (connect to the replica's response headers, its first byte)
whose context goes to the engine in `traceparent`, so the engine's spans join the same trace.

Only the OpenTelemetry API is used here; `corral gateway --otlp-traces-endpoint` (or the OTEL_*
variables) installs the SDK's provider. Without one, nothing is created (one check per request).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

_tracer = trace.get_tracer("corral_gateway")
# W3C trace context and baggage: passed on to the replica as the client sent them, so a gateway
# that does not trace (no provider) still leaves the engine's spans in the client's trace. A
# tracing gateway's `upstream` span replaces the ones it writes itself (start_upstream_span).
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate", "baggage")


def is_enabled() -> bool:
    """Whether a tracer provider is installed (the API's default is a no-op proxy)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def client_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's trace-context headers, for the request to the replica."""
    return {name: headers[name] for name in TRACE_CONTEXT_HEADERS if name in headers}


def _wall_ns(monotonic_s: float) -> int:
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


def start_request_span(headers: Mapping[str, str], method: str, path: str, request_id: str) -> Span | None:
    if not is_enabled():
        return None
    span = _tracer.start_span(f"{method} {path}", context=propagate.extract(headers), kind=SpanKind.SERVER)
    span.set_attribute("http.request.method", method)
    span.set_attribute("url.path", path)
    span.set_attribute("gen_ai.request.id", request_id)
    return span


def record_pick(
    parent: Span, queued_s: float, policy: str, replica: str, scores: Mapping[str, float], attempt: int
) -> None:
    """The wait for a replica (from `queued_s`, time.monotonic()) and which one was picked."""
    span = _tracer.start_span(
        "queue", context=trace.set_span_in_context(parent), start_time=_wall_ns(queued_s)
    )
    span.set_attribute("corral.policy", policy)
    span.set_attribute("corral.replica", replica)
    span.set_attribute("corral.attempt", attempt)
    span.set_attribute(
        "corral.replica_scores", [f"{url}={score:.4f}" for url, score in sorted(scores.items())]
    )
    span.end()


def start_upstream_span(parent: Span, replica: str, attempt: int) -> tuple[Span, dict[str, str]]:
    """The attempt's client span, and the headers that carry its context to the engine."""
    span = _tracer.start_span("upstream", context=trace.set_span_in_context(parent), kind=SpanKind.CLIENT)
    # HTTP client conventions: the host and port apart (a backend's address groups spans by host),
    # the replica's base URL whole.
    where = urlsplit(replica)
    span.set_attribute("url.full", replica)
    if where.hostname:
        span.set_attribute("server.address", where.hostname)
    if where.port is not None:
        span.set_attribute("server.port", where.port)
    span.set_attribute("corral.attempt", attempt)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier


def end_upstream_span(span: Span, status: int | None, retry: str | None) -> None:
    """At the replica's response headers (its first byte), or when the attempt failed before them."""
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if retry is not None:
        span.set_attribute("corral.retry_reason", retry)
        span.set_status(Status(StatusCode.ERROR, retry))
    span.end()


def end_request_span(
    span: Span,
    model: str,
    replica: str,
    status: str,
    prompt_tokens: int | None,
    completion_tokens: int | None,
) -> None:
    span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("corral.replica", replica)
    span.set_attribute("corral.status", status)
    if status.isdigit():
        span.set_attribute("http.response.status_code", int(status))
    if prompt_tokens is not None and completion_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
    if not status.isdigit() or int(status) >= 500:
        span.set_status(Status(StatusCode.ERROR, status))
    span.end()
