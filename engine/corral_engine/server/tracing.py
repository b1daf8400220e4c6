"""OpenTelemetry spans of one API request: a server span continuing the caller's W3C trace
(`traceparent`), with the queue, prefill and decode phases as children, written from the engine's
own timestamps when the request finishes, and GenAI attributes (the names vLLM uses, and the
current semantic conventions' request parameters, response id, finish reasons and token counts).

Only the OpenTelemetry API is used here; `corral engine --otlp-traces-endpoint` (or the OTEL_*
variables) installs the SDK's provider. Without one, nothing is created (one check per request).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams

_tracer = trace.get_tracer("corral_engine")
# Path -> GenAI operation name (the span is named "<operation> <model>").
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/responses": "chat"}


def is_enabled() -> bool:
    """Whether a tracer provider is installed (the API's default is a no-op proxy)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def start_request_span(
    headers: Mapping[str, str],
    method: str,
    path: str,
    model: str,
    server: tuple[str, int | None] | None = None,
) -> Span | None:
    """The request's server span, child of the caller's span when a valid traceparent came in. Only
    a generation is a GenAI span ("<operation> <model>"); any other request (the model list a
    gateway reads every minute) is a plain HTTP one ("GET /v1/models"), so GenAI backends do not
    count it as a call of the model. `server`: the address and port the request came in on (the
    ASGI scope's), which tell the replicas of one service name apart."""
    if not is_enabled():
        return None
    operation = OPERATIONS.get(path)
    name = f"{method} {path}" if operation is None else f"{operation} {model}"
    span = _tracer.start_span(name, context=propagate.extract(headers), kind=SpanKind.SERVER)
    span.set_attribute("http.request.method", method)
    span.set_attribute("url.path", path)
    if server is not None:
        span.set_attribute("server.address", server[0])
        if server[1] is not None:  # None on a Unix socket
            span.set_attribute("server.port", server[1])
    if operation is not None:
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("gen_ai.request.model", model)
    return span


def add_request_params(span: Span, response_id: str, params: SamplingParams) -> None:
    """The GenAI semantic conventions' request attributes (vLLM sets the first three) and the
    response's id; never the texts (stop sequences are client text)."""
    span.set_attribute("gen_ai.response.id", response_id)
    span.set_attribute("gen_ai.request.max_tokens", params.max_tokens)
    span.set_attribute("gen_ai.request.temperature", params.temperature)
    span.set_attribute("gen_ai.request.top_p", params.top_p)
    if params.top_k > 0:
        span.set_attribute("gen_ai.request.top_k", params.top_k)
    if params.seed is not None:
        span.set_attribute("gen_ai.request.seed", params.seed)
    if params.n != 1:
        span.set_attribute("gen_ai.request.choice.count", params.n)
    if params.presence_penalty:
        span.set_attribute("gen_ai.request.presence_penalty", params.presence_penalty)
    if params.frequency_penalty:
        span.set_attribute("gen_ai.request.frequency_penalty", params.frequency_penalty)


def is_generation(path: str) -> bool:
    return path in OPERATIONS


def _wall_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


def add_phases(span: Span, m: RequestMetrics) -> None:
    """Queue wait, prefill and decode of one finished engine request, as child spans of `span`."""
    offset_ns = time.time_ns() - time.monotonic_ns()  # engine timestamps are time.monotonic()
    parent = trace.set_span_in_context(span)
    phases = (
        ("queue", m.arrival_time, m.first_scheduled_time),
        ("prefill", m.first_scheduled_time, m.first_token_time),
        ("decode", m.first_token_time, m.last_token_time),
    )
    for name, start_s, end_s in phases:
        if start_s is None or end_s is None:
            continue
        child = _tracer.start_span(name, context=parent, start_time=_wall_ns(start_s, offset_ns))
        child.end(end_time=_wall_ns(max(start_s, end_s), offset_ns))
    if m.first_token_time is not None:
        span.set_attribute("gen_ai.latency.time_to_first_token", m.first_token_time - m.arrival_time)
    if m.first_scheduled_time is not None:
        span.set_attribute("gen_ai.latency.time_in_queue", m.first_scheduled_time - m.arrival_time)


def end_request_span(
    span: Span,
    path: str,
    request_id: str | None,
    status: int,
    num_prompt_tokens: int,
    num_completion_tokens: int,
    finish_reasons: list[str] | None = None,
) -> None:
    span.set_attribute("http.response.status_code", status)
    if request_id is not None:
        span.set_attribute("gen_ai.request.id", request_id)
    if finish_reasons:  # one per sequence, in the order they finished
        span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
    if is_generation(path):
        span.set_attribute("gen_ai.usage.input_tokens", num_prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", num_completion_tokens)
        # vLLM's names for the same counts.
        span.set_attribute("gen_ai.usage.prompt_tokens", num_prompt_tokens)
        span.set_attribute("gen_ai.usage.completion_tokens", num_completion_tokens)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()
