"""Every error the gateway answers itself, mapped to OpenAI-shaped JSON in this one module."""

from __future__ import annotations

import json
import math
from typing import Any

from corral_engine import wire
from starlette.responses import Response


class GatewayError(Exception):
    """An error answered to the client as `{"error": {...}}` with an HTTP status."""

    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(GatewayError):
    """The client's request is at fault (OpenAI's type for every 4xx but 429)."""

    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(InvalidRequest):
    status_code, code = 401, "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}  # a 401 names its scheme (RFC 9110), as the engine's does


class ModelNotFound(InvalidRequest):
    status_code, code = 404, "model_not_found"

    def __init__(self, model: str, param: str = "model") -> None:
        super().__init__(f"The model `{model}` does not exist.", param=param)


class AmbiguousModel(InvalidRequest):
    status_code, code = 400, "model_ambiguous"

    def __init__(self, model: str, choices: list[str]) -> None:
        listed = ", ".join(f"`{c}`" for c in choices)
        super().__init__(
            f"The model `{model}` is served in several namespaces; ask for one of {listed}.", param="model"
        )


class AmbiguousAdapter(InvalidRequest):
    status_code, code = 400, "model_ambiguous"

    def __init__(self, model: str, bases: list[str]) -> None:
        listed = ", ".join(f"`{b}`" for b in bases)
        super().__init__(
            f"The adapter `{model}` is served for several models ({listed}); it needs a name of its own "
            "for each.",
            param="model",
        )


class NotFound(InvalidRequest):
    status_code, code = 404, "not_found"


class MethodNotAllowed(InvalidRequest):
    status_code, code = 405, "http_405"


class PayloadTooLarge(InvalidRequest):
    status_code, code = 413, wire.CODE_REQUEST_TOO_LARGE


class _RetryLater(GatewayError):
    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}


class RateLimited(_RetryLater):
    """Over a per-key limit, or the model's gateway queue is full."""

    status_code = 429
    error_type = "rate_limit_exceeded"


class Unavailable(_RetryLater):
    """No replica could take the request in time (queue deadline, every replica down)."""

    status_code = 503
    error_type = "service_unavailable"


class Draining(Unavailable):
    """The gateway is stopping: new requests, queued ones, and at the drain's end the open ones."""

    def __init__(self) -> None:
        super().__init__(
            "The gateway is shutting down; retry the request.", retry_after_s=1.0, code="draining"
        )


class ReplicasUnavailable(Unavailable):
    """No replica of the model answered: every one tried refused the connection, timed it out or
    dropped it before its response began. Nothing reached the client, so a retry is safe; 503 with
    Retry-After is what clients (the openai library among them) read as "try later"."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"No replica of model `{model}` could answer the request; retry later.",
            retry_after_s=2.0,
            code="model_unavailable",
        )


class UpstreamTimeout(GatewayError):
    status_code = 504
    error_type = "upstream_timeout"
    code = "first_byte_timeout"


class UpstreamFailed(GatewayError):
    status_code = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class FanoutFailed(GatewayError):
    """A call the gateway sent to every replica of a pool (loading a LoRA adapter) failed on some:
    the first failure's status, type, param and code, with a message naming each failed replica."""

    def __init__(self, message: str, status_code: int, upstream: dict[str, Any] | None) -> None:
        upstream = upstream or {}
        param, code = upstream.get("param"), upstream.get("code")
        super().__init__(
            message,
            param=param if isinstance(param, str) else None,
            code=code if isinstance(code, str) else "replica_failed",
        )
        self.status_code = status_code
        error_type = upstream.get("type")
        if isinstance(error_type, str) and error_type:
            self.error_type = error_type
        else:
            self.error_type = "invalid_request_error" if status_code < 500 else "upstream_error"


def error_body(exc: GatewayError) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}


def error_response(exc: GatewayError) -> Response:
    return Response(
        content=json.dumps(error_body(exc)),
        status_code=exc.status_code,
        headers=exc.headers(),
        media_type="application/json",
    )


SSE_DONE = b"data: [DONE]\n\n"


def sse_error_end(
    message: str, code: str = "upstream_disconnected", error_type: str = "upstream_error"
) -> bytes:
    """The last events of a stream that could not finish (its upstream failed mid-way, or the
    gateway's drain ran out): an error event (the client sees why it ended), then `[DONE]`, as an
    engine ends a stream that fails after it started (clients that read until `[DONE]` would
    otherwise wait for it)."""
    payload = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n" + SSE_DONE


# (message, code, type) of the error that ends a stream still open when the gateway's drain runs out.
DRAINING_END = (Draining().message, "draining", Draining.error_type)


def sse_responses_error_end(
    message: str,
    code: str,
    error_type: str,
    last_sequence_number: int | None,
    response: dict[str, Any] | None,
) -> bytes:
    """How a Responses stream that could not finish ends (it has no `[DONE]`): an `error` event,
    then `response.failed` with the response its `response.created` carried, where it was kept.
    The error event has the documented top-level fields and OpenAI's nested `error` object too,
    which the openai library raises as an APIError."""
    number = -1 if last_sequence_number is None else last_sequence_number
    nested = {"message": message, "type": error_type, "param": None, "code": code}
    error = {"type": "error", "code": code, "message": message, "param": None, "error": nested}
    events = _typed_event("error", error, number + 1)
    if response is not None:
        # `code` is one of the Response object's own error codes; `message` tells what happened.
        failed = {**response, "status": "failed", "error": {"code": "server_error", "message": message}}
        events += _typed_event("response.failed", {"type": "response.failed", "response": failed}, number + 2)
    return events


def _typed_event(kind: str, payload: dict[str, Any], sequence_number: int) -> bytes:
    data = json.dumps({**payload, "sequence_number": sequence_number})
    return f"event: {kind}\ndata: {data}\n\n".encode()
