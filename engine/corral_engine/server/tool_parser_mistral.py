"""Mistral's tool calls (`--tool-call-parser mistral`): content, then `[TOOL_CALLS]` and the
calls, in the v0.3 JSON form or the v11+ `name[ARGS]{...}` form; and the call ids Mistral's
templates accept."""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Collection

from corral_engine.server.call_scanner import CallScanner
from corral_engine.server.tool_events import CallReader, Content, ToolEvent, held_back

_SKIPPED = re.compile(r"[ \t\r\n,\]]*")  # between calls: white space, `,`, an array's end
# a name, then optionally `[CALL_ID]id` and `[ARGS]` (special tokens: the text may lack them)
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(\[CALL_ID\][A-Za-z0-9]*)?(\[ARGS\])?")
_TAGS = ("[CALL_ID]", "[ARGS]")
# Special tokens in Mistral's tokenizers: the server has the engine show them in a reply's text
# (it leaves special tokens out otherwise), for this parser to read.
MISTRAL_MARKERS = ("[TOOL_CALLS]", *_TAGS)
_MAX_NAME_CHARS = 64  # as tools' names (api_tools.FunctionDef)


class _MistralCalls:
    """Mistral's calls one after another: call objects (`{"name", "arguments"}`, in a JSON array
    or not) and `name[CALL_ID]id[ARGS]{arguments}` items, between white space, `,`, `[`, `]` and
    further `[TOOL_CALLS]` markers. Anything else ends them (`is_over`). Until a marker was read,
    a call naming none of `names` (where given) ends them too."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self, names: Collection[str] | None) -> None:
        self.names = names
        self.is_over = False
        self.num_calls = 0  # calls started so far
        self._call: CallReader | None = None
        self._pending = ""  # text that may still be a marker or a name being read

    def feed(self, text: str, out: list[ToolEvent], is_final: bool = False) -> None:
        text, self._pending = self._pending + text, ""
        i = 0
        while i < len(text) and not self.is_over:
            if self._call is None:
                at = self._next_item(text, i, is_final)
                if at is None:  # undecided until more text arrives
                    self._pending = text[i:]
                    return
                i = at
                continue
            call = self._call
            i = call.feed(text, i, out)
            if call.is_over:
                self.is_over = not call.is_started
                self._call = None
            if call.is_started and call.index == self.num_calls:
                self.num_calls += 1

    def _next_item(self, text: str, i: int, is_final: bool) -> int | None:
        """Read separators or start the next call at `text[i]`; where reading goes on (None: wait)."""
        skipped = _SKIPPED.match(text, i)
        i = skipped.end() if skipped is not None else i
        if i == len(text):
            return i
        rest = text[i : i + len(self.MARKER)]
        if rest == self.MARKER:
            self.names = None  # marked calls are calls whatever they name
            return i + len(rest)
        if text[i] == "[":
            if self.MARKER.startswith(rest) and not is_final:
                return None
            return i + 1  # an array's start
        if text[i] == "{":
            self._call = CallReader(self.num_calls, self.names)
            return i
        return self._named_call(text, i, is_final)

    def _named_call(self, text: str, i: int, is_final: bool) -> int | None:
        match = _NAMED.match(text, i)
        end = i if match is None else match.end()
        is_long = match is not None and len(match.group(1)) > _MAX_NAME_CHARS  # no name: stop reading
        if not (is_final or is_long) and (end == len(text) or any(t.startswith(text[end:]) for t in _TAGS)):
            return None
        name = None if match is None else match.group(1)
        has_args = match is not None and match.group(3) is not None
        is_offered = self.names is None or name in self.names
        # without its [ARGS] tag, a name is a call only if an object follows it at once
        if name is None or is_long or not is_offered or not (has_args or text.startswith("{", end)):
            self.is_over = True
            return end
        self._call = CallReader(self.num_calls, None, CallScanner.arguments_of(name))
        return end

    def finish(self, out: list[ToolEvent]) -> None:
        if self._pending:
            self.feed("", out, is_final=True)
        if self._call is not None:  # named, its arguments not begun: a call all the same
            self._call.feed("", 0, out)


class MistralParser:
    """Mistral: content, then `[TOOL_CALLS]` and the calls: a JSON array of `{"name",
    "arguments"}` objects (v0.3 tokenizers) or `name[ARGS]{arguments}` items, each after its own
    marker (v11+ tokenizers; `[CALL_ID]id` may precede `[ARGS]`). Text after the calls is dropped.
    These markers are special tokens, which the reply's text shows for this parser
    (MISTRAL_MARKERS). A model may also leave them out: a reply that opens with calls without them
    (`[{"name": ...}]`, or `name{...}`) is read as calls too when its first call names a function
    in `tools`; otherwise such a reply is content."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._reply = ""  # "start": the reply so far; "content": text held back
        self._mode = "start"  # then "content" or "calls"
        self._calls = _MistralCalls(tool_names)

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._mode == "calls":
            self._calls.feed(text, out)
        elif self._mode == "content":
            self._content(text, out)
        else:
            self._start(text, out, is_final=False)
        return out

    def _start(self, text: str, out: list[ToolEvent], is_final: bool) -> None:
        """A reply that opens with calls (marked or not) is calls; one whose opening is not a
        call is content, read again for a later marker."""
        self._reply += text
        self._calls.feed(text, out, is_final)
        if self._calls.num_calls:
            self._mode, self._reply = "calls", ""
        elif self._calls.is_over or is_final:
            self._mode, reply, self._reply = "content", self._reply, ""
            self._calls = _MistralCalls(None)
            self._content(reply, out)

    def _content(self, text: str, out: list[ToolEvent]) -> None:
        self._reply += text
        start = self._reply.find(_MistralCalls.MARKER)
        cut = start if start != -1 else len(self._reply) - held_back(self._reply, _MistralCalls.MARKER)
        if cut:
            out.append(Content(self._reply[:cut]))
        rest, self._reply = self._reply[cut:], ""
        if start == -1:
            self._reply = rest
        else:
            self._mode = "calls"
            self._calls.feed(rest, out)

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._mode == "start":
            self._start("", out, is_final=True)
        if self._mode == "calls":
            self._calls.finish(out)
        elif self._reply:
            out.append(Content(self._reply))
        self._reply = ""
        return out


def mistral_call_id() -> str:
    """A call id as Mistral's chat templates require (they refuse others): 9 letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))
