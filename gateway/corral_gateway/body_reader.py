"""What a response body's bytes told the gateway as they passed through (never changing them): the
usage its end reports and, for an event stream, whether it had ended (chat's `data: [DONE]`, a
Responses stream's terminal event), its last event's name, and a Responses stream's first event and
last `sequence_number`, read from one buffer of its last bytes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from corral_gateway.errors import SSE_DONE

_TAIL_BYTES = 4096  # enough for the usage object at the end of a response
# The buffer grows to this before it is read and cut back to _TAIL_BYTES: a cut per few KiB.
_MAX_TAIL_BYTES = 3 * _TAIL_BYTES
# Chat's and completions' names, and the Responses API's (`input_tokens`, `output_tokens`).
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')

# The events that end a Responses stream (OpenAI's, vLLM's and the engine's).
_TERMINAL_EVENTS = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
# An event line starts a line; a `data` line's JSON holds no raw newline, so text a model wrote
# (even "event: response.completed") is never read as one.
_EVENT_LINE = b"\nevent:"
_CARRY_BYTES = 64  # read again with the next bytes: an event line split across chunks is read whole
# A key's closing quote is never escaped, one inside a JSON string always is: text a model wrote
# cannot match.
_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)[^\d]')
_SEQUENCE_KEY = b'"sequence_number":'
# The first event (response.created) carries the response a failure event repeats; it echoes the
# request's instructions and tools, so only a first event up to this size is kept.
_MAX_HEAD_BYTES = 256 * 1024
_EVENT_END = re.compile(rb"\r?\n\r?\n")


@dataclass(frozen=True, slots=True)
class ReportedUsage:
    """The last `usage` object of a response (a stream's last one holds the totals)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class BodyReader:
    """Reads a body's chunks as they pass, into one buffer of its last bytes: the usage its end
    reports and, for an event stream, the name of its last whole event line; for a Responses stream
    (one whose events are named) its first event and last `sequence_number`. A chunk is only kept;
    the events are read from the buffer before it is cut back (the terminal event carries the whole
    response, often more than the usage needs) and when asked, so a chunk costs an append."""

    __slots__ = (
        "_first_event",
        "_head",
        "_is_events",
        "_is_start_kept",
        "_last_event",
        "_last_sequence_number",
        "_num_read",
        "_tail",
    )

    def __init__(self, *, is_events: bool = True) -> None:
        # After a "\n" that makes the body's first line start a line too (never part of `end`).
        self._tail = bytearray(b"\n")
        self._is_start_kept = True  # the tail still starts with that "\n": nothing was cut yet
        self._num_read = 0  # the tail's bytes whose events were read
        self._is_events = is_events  # an event stream: its events are read too
        self._head: bytearray | None = bytearray() if is_events else None  # till its first event ends
        self._first_event: bytes | None = None  # the bytes up to the end of its first event
        self._last_event = b""
        self._last_sequence_number: int | None = None

    def feed(self, chunk: bytes) -> None:
        tail = self._tail
        tail += chunk
        if self._head is not None:
            self._read_head(self._head, chunk)
        if len(tail) > _MAX_TAIL_BYTES:
            self._read_events()
            del tail[:-_TAIL_BYTES]
            self._num_read, self._is_start_kept = len(tail), False

    @property
    def is_responses(self) -> bool:
        """The stream names its events (OpenAI's Responses API): it ends without `[DONE]`."""
        self._read_events()
        return bool(self._last_event)

    @property
    def last_sequence_number(self) -> int | None:
        """A Responses stream's last event's number, once a whole one has passed."""
        self._read_events()
        return self._last_sequence_number

    def has_ended(self) -> bool:
        """The stream's last event is whole and ends it: only the end of its body was lost."""
        tail = self._tail
        if tail.endswith(SSE_DONE):
            return True
        self._read_events()
        return self._last_event in _TERMINAL_EVENTS and tail.endswith((b"\n\n", b"\r\n\r\n"))

    def end(self, num_bytes: int) -> bytes:
        """The body's last `num_bytes` bytes so far (fewer while it is shorter)."""
        tail = self._tail
        return bytes(tail[max(len(tail) - num_bytes, 1 if self._is_start_kept else 0) :])

    def _read_events(self) -> None:
        """The last whole event line's name, and a Responses stream's last whole `sequence_number`,
        in the bytes not read yet (and a few read ones: a line split across chunks is read whole)."""
        if not self._is_events:
            return
        tail = self._tail
        start = max(0, self._num_read - _CARRY_BYTES)
        self._num_read = len(tail)
        line = tail.rfind(_EVENT_LINE, start)
        line_end = tail.find(b"\n", line + 1) if line != -1 else -1
        if line != -1 and line_end == -1:  # not all here yet: read again later; the one before is whole
            line = tail.rfind(_EVENT_LINE, start, line)
            line_end = tail.find(b"\n", line + 1) if line != -1 else -1
        if line != -1:
            self._last_event = bytes(tail[line + len(_EVENT_LINE) : line_end]).strip()
        if not self._last_event:
            return  # not a Responses stream: its events are not numbered
        key = tail.rfind(_SEQUENCE_KEY, start)
        while key != -1:
            if (match := _SEQUENCE_NUMBER.match(tail, key)) is not None:
                self._last_sequence_number = int(match.group(1))
                return
            key = tail.rfind(_SEQUENCE_KEY, start, key)  # its number is not all here yet

    def _read_head(self, head: bytearray, chunk: bytes) -> None:
        """The first event's bytes, kept till that event ends (or has grown too large to keep)."""
        if len(head) >= _MAX_HEAD_BYTES:
            self._head = None  # too large to keep: a failure event then carries no response
            return
        seen = max(0, len(head) - 3)  # an event's end split across chunks is found whole
        head += chunk
        if head.find(b"\n\n", seen) != -1 or head.find(b"\r\n\r\n", seen) != -1:
            self._first_event, self._head = bytes(head), None

    def reported(self) -> ReportedUsage | None:
        """None when the body reported no usage (a stream without `include_usage`, an error)."""
        tail = bytes(self._tail[-_TAIL_BYTES:])
        total = _TOTAL_TOKENS.findall(tail)
        if not total:
            return None
        prompt, completion = _PROMPT_TOKENS.findall(tail), _COMPLETION_TOKENS.findall(tail)
        return ReportedUsage(
            int(prompt[-1]) if prompt else 0, int(completion[-1]) if completion else 0, int(total[-1])
        )

    def created_response(self) -> dict[str, Any] | None:
        """The response its first event (response.created) carried, when that event was kept."""
        if self._first_event is None:
            return None
        first = _EVENT_END.split(self._first_event, maxsplit=1)[0]
        data = b"".join(
            line.removeprefix(b"data:").strip() for line in first.splitlines() if line.startswith(b"data:")
        )
        try:
            event = json.loads(data)
        except ValueError:
            return None
        response = event.get("response") if isinstance(event, dict) else None
        return response if isinstance(response, dict) and "id" in response else None
