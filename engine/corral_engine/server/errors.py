"""Every failure of the engine server becomes an OpenAI-style JSON error here, and only here.

Body: {"error": {"message", "type", "param", "code"}}. 400 invalid request, 401 bad API key,
404 unknown model or route, 429 (with Retry-After) queue full, 503 draining or engine dead.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from corral_engine import wire
from corral_engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from corral_engine.server import access

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key; pass it as 'Authorization: Bearer KEY'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def draining() -> APIError:
    return APIError(503, "The server is shutting down.", type="service_unavailable_error", code="draining")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "body"})


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    """`messages.0.content` from a pydantic location, without union-branch tags like `list[int]`."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p))]
    return ".".join(parts) or None


def _from_validation(errors: list[Any]) -> APIError:
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    kind = first.get("type", "")
    message = str(first.get("msg", "invalid request"))
    if kind == "json_invalid":
        return invalid_request(f"We could not parse the JSON body of your request: {message}")
    if kind == "value_error":  # our validators' own words, without pydantic's "Value error, "
        message = message.removeprefix("Value error, ")
    param = _validation_param(loc)
    prefix = f"{param}: " if param else ""
    return invalid_request(prefix + message, param)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the API error a client sees; unknown ones are 500s (logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return invalid_request(str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        if exc.num_waiting is not None:  # the queue it was refused on, not the last step's
            headers[wire.HEADER_NUM_WAITING] = str(exc.num_waiting)
        return APIError(
            429,
            str(exc) or "The server is overloaded; retry later.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=headers,
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc) or "The engine is not running.", type="service_unavailable_error")
    if isinstance(exc, ValidationError | RequestValidationError):
        return _from_validation(list(exc.errors()))
    if isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        if status == 404:
            return APIError(404, "Not found.", code="not_found")
        return APIError(status, str(exc.detail), headers=dict(exc.headers or {}))
    if isinstance(exc, RecursionError):
        return invalid_request("The request is nested too deeply.")
    access.log_for_request(logger, logging.ERROR, "internal error", exc_info=exc)
    return APIError(500, "The server had an internal error.", type="internal_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The error body, for sending inside an already-started SSE stream."""
    return to_api_error(exc).body()


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 404:
        # Named, so a client calling an endpoint this server lacks (`/v1/rerank`, say) does
        # not read the 404 as an unknown model.
        route = f"{request.method} {request.url.path}"
        return error_response(APIError(404, f"This server has no route {route}.", code="not_found"))
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    for exc_type in (
        APIError,
        InvalidRequestError,
        QueueFullError,
        EngineDeadError,
        ValidationError,
        RequestValidationError,
        StarletteHTTPException,
    ):
        app.add_exception_handler(exc_type, _handle)
