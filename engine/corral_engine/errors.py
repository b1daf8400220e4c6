"""Errors the engine raises to its callers (light; no torch). The server maps them to HTTP."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given (400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(EngineError):
    """The waiting queue is at max_waiting (429); retry after `retry_after_s`. `num_waiting`: the
    requests that would not run at the next step when it refused (`StreamFront.num_waiting_now`)."""

    def __init__(self, message: str, retry_after_s: float = 1.0, num_waiting: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.num_waiting = num_waiting


class RequestAbortedError(EngineError):
    """A request aborted before the engine took it: it has no output, and its stream ends with this."""


class EngineDeadError(EngineError):
    """The step loop died or is shutting down (503)."""


class ModelLoadError(EngineError):
    """A checkpoint cannot be loaded: unsupported architecture, missing or malformed files."""
