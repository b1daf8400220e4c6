"""The process's logging, set up once by `corral`: plain text lines, or one JSON object a line
(`--log-format json`) whose keys are the record's time, level, logger and message plus the fields a
call passes in `extra` (request id, model, replica, status, tokens, latency)."""

from __future__ import annotations

import logging
import sys
from typing import Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# C0 controls (but tab and newline) and DEL, written as escapes; a newline starts an indented
# continuation. A request's path or field names reach some lines, and a newline in one forged a
# whole log line after it; messages of several lines (an engine's log tail) stay readable.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x09), *range(0x0B, 0x20), 0x7F)} | {0x0D: "\\r"}
CONTINUATION = "\n    "


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT; a line that does not start with the time belongs to the record above it (an
    indented continuation, or a traceback, added after the message)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_ESCAPES).replace("\n", CONTINUATION)
        return super().formatMessage(record)


def json_formatter() -> logging.Formatter:
    from pythonjsonlogger.core import RESERVED_ATTRS
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",  # ISO 8601, UTC
        # uvicorn passes its message again with terminal colour codes; a log pipeline wants one.
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],
    )


def configure(level: str, log_format: LogFormat) -> None:
    """One handler on stderr in the chosen format (a no-op where the root logger already has
    handlers, as under pytest)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
