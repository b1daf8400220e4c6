"""What the gateway records when a request ends: one access log line (on by default) and the
per-API-key token counters. Keys appear by their name from the keys file (or a short hash of the
key); prompts, completions and the keys themselves never do."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from corral_engine import wire
from opentelemetry.trace import Span

from corral_gateway import tracing
from corral_gateway.body_reader import ReportedUsage
from corral_gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)


def request_id_for(headers: Mapping[str, str]) -> str:
    """The request's id: the client's `x-request-id` where valid, else a new one. New ones are
    random (128 bits from the OS, ~1 us), as vLLM's and OpenAI's are: the engine shows the id in
    the response's `id`, so it must not tell a client how many requests came before or let it
    guess another client's."""
    return wire.valid_request_id(headers.get(wire.HEADER_REQUEST_ID)) or secrets.token_hex(16)


@dataclass(frozen=True, slots=True)
class Origin:
    """Which request a response answers: for metrics and logs."""

    model: str
    request_id: str
    start_s: float  # time.monotonic() at arrival
    key_name: str = ""  # the API key's name; "" when the gateway checks no keys
    span: Span | None = None  # the request's server span, while tracing


class AccessLog:
    def __init__(self, metrics: GatewayMetrics, is_enabled: bool = True) -> None:
        self.metrics = metrics
        self.is_enabled = is_enabled

    def finished(
        self,
        origin: Origin,
        replica: str,
        status: str,
        usage: ReportedUsage | None,
        ended: str | None = None,
    ) -> None:
        """Record a request that has ended, however it ended (`replica` is "" when none served it;
        `ended` says why a response that began ended early): its span ends, the key's tokens are
        counted, and its access line is written."""
        prompt = usage.prompt_tokens if usage is not None else None
        completion = usage.completion_tokens if usage is not None else None
        if origin.span is not None:
            tracing.end_request_span(origin.span, origin.model, replica, status, prompt, completion)
        if usage is not None and origin.key_name:
            tokens = self.metrics.key_tokens
            tokens.labels(origin.key_name, origin.model, "prompt").inc(usage.prompt_tokens)
            tokens.labels(origin.key_name, origin.model, "completion").inc(usage.completion_tokens)
        if not self.is_enabled:
            return
        duration_s = time.monotonic() - origin.start_s
        fields = {
            "request_id": origin.request_id,
            "model": origin.model,
            "replica": replica,
            "status": status,
            "ended": ended,
            "key": origin.key_name,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "latency_s": round(duration_s, 6),
        }
        logger.info(
            "request %s: model %s, replica %s, status %s%s, %s prompt + %s completion tokens, %.3f s",
            origin.request_id,
            origin.model,
            replica or "-",
            status,
            "" if ended is None else f" (ended early: {ended})",
            "?" if prompt is None else prompt,
            "?" if completion is None else completion,
            duration_s,
            extra=fields,
        )
