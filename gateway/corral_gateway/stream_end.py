"""Whether a replica's event stream had ended when its connection broke: chat's and completions'
streams end with `data: [DONE]`, the Responses API's with its terminal event (no `[DONE]`)."""

from __future__ import annotations

from corral_gateway.errors import SSE_DONE

# The events that end a Responses stream (OpenAI's, vLLM's and the engine's).
_TERMINAL_EVENTS = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
# An event line starts a line; a `data` line's JSON holds no raw newline, so text a model wrote
# (even "event: response.completed") is never read as one.
_EVENT_LINE = b"\nevent:"
_CARRY_BYTES = 64  # kept from a chunk's end: an event line split across chunks is read whole


class StreamEnd:
    """Reads an event stream's chunks as they pass: the name of its last event line, and its last
    bytes. The terminal event carries the whole response (often more than the usage tail keeps),
    so its name is read as it passes."""

    __slots__ = ("_carry", "_last_event")

    def __init__(self) -> None:
        self._carry = b""
        self._last_event = b""

    def feed(self, chunk: bytes) -> None:
        seen = self._carry + chunk
        start = seen.rfind(_EVENT_LINE)
        if start != -1:
            end = seen.find(b"\n", start + 1)
            if end != -1:  # else the line is not all here yet: the carry keeps its start
                self._last_event = seen[start + len(_EVENT_LINE) : end].strip()
        self._carry = seen[-_CARRY_BYTES:]

    def has_ended(self) -> bool:
        """The stream's last event is whole and ends it: only the end of its body was lost."""
        if self._carry.endswith(SSE_DONE):
            return True
        return self._last_event in _TERMINAL_EVENTS and self._carry.endswith((b"\n\n", b"\r\n\r\n"))
