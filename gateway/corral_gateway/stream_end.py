"""Whether a replica's event stream had ended when its connection broke: chat's and completions'
streams end with `data: [DONE]`, the Responses API's with its terminal event (no `[DONE]`); and,
for a Responses stream, what ending it the Responses way needs (its response, its numbering)."""

from __future__ import annotations

import json
import re
from typing import Any

from corral_gateway.errors import SSE_DONE

# The events that end a Responses stream (OpenAI's, vLLM's and the engine's).
_TERMINAL_EVENTS = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
# An event line starts a line; a `data` line's JSON holds no raw newline, so text a model wrote
# (even "event: response.completed") is never read as one.
_EVENT_LINE = b"\nevent:"
_CARRY_BYTES = 64  # kept from a chunk's end: an event line split across chunks is read whole
# A key's closing quote is never escaped, one inside a JSON string always is: text a model wrote
# cannot match.
_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)[^\d]')
_SEQUENCE_KEY = b'"sequence_number":'
# The first event (response.created) carries the response a failure event repeats; it echoes the
# request's instructions and tools, so only a first event up to this size is kept.
_MAX_HEAD_BYTES = 256 * 1024
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class StreamEnd:
    """Reads an event stream's chunks as they pass: the name of its last event line, its last
    bytes, and for a Responses stream (one whose events are named) its first event and its last
    `sequence_number`. The terminal event carries the whole response (often more than the usage
    tail keeps), so its name is read as it passes."""

    __slots__ = ("_carry", "_head", "_is_head_whole", "_last_event", "last_sequence_number")

    def __init__(self) -> None:
        self._carry = b"\n"  # the stream's first line starts a line too
        self._head: bytes | None = b""  # the first event's bytes (None: too large to keep)
        self._is_head_whole = False
        self._last_event = b""
        self.last_sequence_number: int | None = None

    @property
    def is_responses(self) -> bool:
        """The stream names its events (OpenAI's Responses API): it ends without `[DONE]`."""
        return bool(self._last_event)

    def feed(self, chunk: bytes) -> None:
        if self._head is not None and not self._is_head_whole:
            self._head = self._head + chunk if len(self._head) < _MAX_HEAD_BYTES else None
            self._is_head_whole = self._head is not None and _is_whole_event(self._head)
        seen = self._carry + chunk
        start = seen.rfind(_EVENT_LINE)
        if start != -1:
            end = seen.find(b"\n", start + 1)
            if end != -1:  # else the line is not all here yet: the carry keeps its start
                self._last_event = seen[start + len(_EVENT_LINE) : end].strip()
        if self._last_event:  # a Responses stream: its events are numbered
            key = seen.rfind(_SEQUENCE_KEY)
            if key != -1 and (match := _SEQUENCE_NUMBER.match(seen, key)) is not None:
                self.last_sequence_number = int(match.group(1))
        self._carry = seen[-_CARRY_BYTES:]

    def has_ended(self) -> bool:
        """The stream's last event is whole and ends it: only the end of its body was lost."""
        if self._carry.endswith(SSE_DONE):
            return True
        return self._last_event in _TERMINAL_EVENTS and self._carry.endswith((b"\n\n", b"\r\n\r\n"))

    def created_response(self) -> dict[str, Any] | None:
        """The response its first event (response.created) carried, when that event was kept."""
        if self._head is None or not self._is_head_whole:
            return None
        first = _EVENT_END.split(self._head, maxsplit=1)[0]
        data = b"".join(
            line.removeprefix(b"data:").strip() for line in first.splitlines() if line.startswith(b"data:")
        )
        try:
            event = json.loads(data)
        except ValueError:
            return None
        response = event.get("response") if isinstance(event, dict) else None
        return response if isinstance(response, dict) and "id" in response else None


def _is_whole_event(head: bytes) -> bool:
    return b"\n\n" in head or b"\r\n\r\n" in head
