"""One API request's access record: its id (a valid incoming x-request-id, else one minted here),
status, tokens and latency, logged as one line when the response ends. A probe or scrape that
succeeds writes no line unless asked for; one that fails (or never answers) always does.

The record lives in a context variable set by the middleware, so the handlers (and the tasks they
start, which copy the context) reach it without passing it down. Never holds prompts or keys.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from corral_engine import wire
from corral_engine.outputs import RequestOutput
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import tracing

logger = logging.getLogger(__name__)

_CURRENT: ContextVar[AccessRecord | None] = ContextVar("corral_access_record", default=None)
# Reads that kubelet, Prometheus and routers repeat all day: the gateway lists each replica's
# models every minute and polls its /health whenever it is idle. vLLM leaves such lines out with
# --disable-access-log-for-endpoints, which OpenShift AI's KServe template sets to /health,
# /metrics and /ping.
PROBE_PATHS = frozenset({"/health", "/metrics", "/v1/models"})
_PROBE_METHODS = frozenset({"GET", "HEAD"})


@dataclass(slots=True)
class AccessRecord:
    request_id: str | None  # the incoming id, or the one minted for the response; None until then
    start_s: float  # time.monotonic() at arrival
    status: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    span: Span | None = None  # the request's server span, while tracing
    finish_reasons: list[str] = field(default_factory=list)  # its sequences', while tracing

    def ensure_id(self) -> str:
        if self.request_id is None:
            self.request_id = uuid.uuid4().hex
        return self.request_id


def begin(
    headers: Mapping[str, str],
    method: str,
    path: str,
    model: str,
    server: tuple[str, int | None] | None = None,
) -> AccessRecord:
    """A record for the request now starting, current for the rest of this context; `server` is
    the address and port it came in on."""
    record = AccessRecord(wire.valid_request_id(headers.get(wire.HEADER_REQUEST_ID)), time.monotonic())
    record.span = tracing.start_request_span(headers, method, path, model, server)
    _CURRENT.set(record)
    return record


def current_id() -> str | None:
    """The id of the request this context serves (minted now if it has none yet, so a log line
    and the response's header agree), or None outside an API request."""
    record = _CURRENT.get()
    return record.ensure_id() if record is not None else None


def log_for_request(
    logger: logging.Logger, level: int, message: str, *args: object, exc_info: BaseException | None = None
) -> None:
    """A line about the request this context serves: `request <id>: <message>`, with the id as
    the JSON field `request_id`, so a log pipeline joins it to the access line."""
    request_id = current_id()
    logger.log(
        level, "request %s: " + message, request_id or "-", *args, exc_info=exc_info,
        extra={"request_id": request_id},
    )  # fmt: skip


def response_id(prefix: str) -> str:
    """`<prefix>-<request id>` (vLLM's shape): the response's `id`, and the engine's request id."""
    record = _CURRENT.get()
    base = record.ensure_id() if record is not None else uuid.uuid4().hex
    return f"{prefix}-{base}"


def note_generation(response_id: str, params: SamplingParams) -> None:
    """The current request's generation begins: its span gets the response id and parameters."""
    record = _CURRENT.get()
    if record is not None and record.span is not None:
        tracing.add_request_params(record.span, response_id, params)


def count_tokens(out: RequestOutput, num_completion_tokens: int | None = None) -> None:
    """Add a finished engine request's tokens to the current record; for one ended early, its
    latest output and the `num_completion_tokens` it had produced by then."""
    record = _CURRENT.get()
    if record is not None:
        record.num_prompt_tokens += len(out.prompt_token_ids)
        if num_completion_tokens is None:
            num_completion_tokens = sum(len(o.token_ids) for o in out.outputs)
        record.num_completion_tokens += num_completion_tokens
        if record.span is not None:
            tracing.add_phases(record.span, out.metrics)
            record.finish_reasons.extend(o.finish_reason for o in out.outputs if o.finish_reason)


def is_probe(method: str, path: str) -> bool:
    """A read of /health, /metrics or the model list (or one entry of it)."""
    return method in _PROBE_METHODS and (path in PROBE_PATHS or path.startswith("/v1/models/"))


def log_request(record: AccessRecord, method: str, path: str, model: str, log_probes: bool = False) -> None:
    """The request's access line (and the end of its span): a probe's only when it failed, or
    when `log_probes` (the engine's --log-probe-requests)."""
    if record.span is not None:
        tracing.end_request_span(
            record.span,
            path,
            record.request_id,
            record.status,
            record.num_prompt_tokens,
            record.num_completion_tokens,
            record.finish_reasons,
        )
    if not log_probes and 0 < record.status < 400 and is_probe(method, path):
        return  # a probe that succeeded
    latency_s = time.monotonic() - record.start_s
    fields = {
        "request_id": record.request_id,
        "model": model,
        "method": method,
        "path": path,
        "status": record.status,
        "prompt_tokens": record.num_prompt_tokens,
        "completion_tokens": record.num_completion_tokens,
        "latency_s": round(latency_s, 6),
    }
    logger.info(
        "request %s: %s %s %d, %d prompt + %d completion tokens, %.3f s",
        record.request_id or "-",  # a probe's: it has no id
        method,
        path,
        record.status,
        record.num_prompt_tokens,
        record.num_completion_tokens,
        latency_s,
        extra=fields,
    )
