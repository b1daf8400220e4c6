"""Tool calls parsed out of generated text (`--tool-call-parser`), as the text streams.

A parser is fed a reply's text in pieces and answers with events: content, the start of a call
(its name, as soon as the name's string closes), and pieces of that call's arguments (the model's
own text of them, as it is written). A whole reply is one feed, so a stream's events add up to the
whole reply's, however the text was split. Content that could still start a call's marker is held
back until it cannot; text inside a call is never content. A call is a call once it is named,
whatever follows (a reply cut off by max_tokens ends with a call whose arguments are cut off too).
"""

from __future__ import annotations

import re
import secrets
import string
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from corral_engine.server.call_scanner import CallScanner


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # 0, 1, ... in the order the reply names them
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = Content | CallStart | ArgumentsDelta


class ToolParser(Protocol):
    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...  # the reply ended: whatever was held back


class ToolParserClass(Protocol):
    """A parser for a request offering the functions `tool_names` (None: any name)."""

    def __call__(self, tool_names: Collection[str] | None = None) -> ToolParser: ...


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str
    calls: list[ParsedCall]


def collect(events: list[ToolEvent]) -> Parsed:
    """What a list of events adds up to (as a client accumulating the deltas sees it)."""
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            names.append(event.name)
            arguments.append([])
        else:
            arguments[event.index].append(event.text)
    calls = [ParsedCall(name, "".join(args)) for name, args in zip(names, arguments, strict=True)]
    return Parsed("".join(content), calls)


def parse_whole(make_parser: Callable[[], ToolParser], text: str) -> Parsed:
    parser = make_parser()
    return collect(parser.feed(text) + parser.finish())


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _Call:
    """One call object being read. Its events begin once its name is known; arguments read
    before that (a model may write them first) wait for it. With `names`, an object naming
    anything else is not a call (it is over, never started)."""

    def __init__(
        self, index: int, names: Collection[str] | None = None, scanner: CallScanner | None = None
    ) -> None:
        self.index = index
        self.scanner = scanner if scanner is not None else CallScanner()
        self.is_started = False
        self.is_refused = False
        self._names = names
        self._early = ""

    @property
    def is_over(self) -> bool:
        return self.scanner.is_done or self.scanner.is_failed or self.is_refused

    def feed(self, text: str, start: int, out: list[ToolEvent]) -> int:
        end = self.scanner.feed(text, start)
        arguments = self.scanner.take_arguments()
        if not self.is_started:
            if self.scanner.name is None:
                self._early += arguments
                return end
            if self._names is not None and self.scanner.name not in self._names:
                self.is_refused = True
                return end
            self.is_started = True
            out.append(CallStart(self.index, self.scanner.name))
            arguments, self._early = self._early + arguments, ""
        if arguments:
            out.append(ArgumentsDelta(self.index, arguments))
        return end


class _CallSequence:
    """Call objects one after another with `separators` between them. Anything else, or an
    object that is not a call (or names none of `names`, where given), ends the sequence
    (`is_over`)."""

    def __init__(self, separators: str, names: Collection[str] | None = None) -> None:
        self.separators = separators
        self.names = names
        self.is_over = False
        self._num_done = 0  # calls read to their end
        self._call: _Call | None = None

    @property
    def num_calls(self) -> int:
        """Calls started so far."""
        return self._num_done + (self._call is not None and self._call.is_started)

    def feed(self, text: str, start: int, out: list[ToolEvent]) -> None:
        i, n = start, len(text)
        while i < n and not self.is_over:
            if self._call is None:
                while i < n and text[i] in self.separators:
                    i += 1
                if i == n:
                    return
                if text[i] != "{":
                    self.is_over = True
                    return
                self._call = _Call(self._num_done, self.names)
            i = self._call.feed(text, i, out)
            if self._call.is_over:
                self.is_over = not self._call.is_started
                self._num_done += self._call.is_started
                self._call = None


class HermesParser:
    """Hermes / Qwen 2.5 and 3: content, then `<tool_call>{"name", "arguments"}</tool_call>` blocks.
    Content is what precedes the first block. A block without a named call is dropped; an unclosed
    one at the end of the reply is a call if named, else content. A block is a call whatever it
    names (its tags say it is one; the client can answer that no such tool exists), so
    `tool_names` is not consulted."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._buffer = ""  # outside a block: held-back text; inside: the block's text after START
        self._call: _Call | None = None  # inside a block
        self._num_fed = 0  # of the block's text, what its call has read
        self._num_calls = 0
        self._has_block = False  # content ends where the first block starts

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self._buffer += text
        while self._advance(out):
            pass
        return out

    def _advance(self, out: list[ToolEvent]) -> bool:
        """Consume what can be decided; True when the mode changed and there may be more."""
        if self._call is None:
            start = self._buffer.find(self.START)
            cut = start if start != -1 else len(self._buffer) - _held_back(self._buffer, self.START)
            if cut and not self._has_block:
                out.append(Content(self._buffer[:cut]))
            if start == -1:
                self._buffer = self._buffer[cut:]
                return False
            self._buffer = self._buffer[start + len(self.START) :]
            self._call, self._num_fed, self._has_block = _Call(self._num_calls), 0, True
            return True
        call = self._call
        end = self._buffer.find(self.END, self._num_fed)
        # Text that may be the start of END is not fed to the call until it is known not to be.
        safe = end if end != -1 else len(self._buffer) - _held_back(self._buffer, self.END)
        self._feed_call(call, max(safe, self._num_fed), out)
        if end == -1:
            return False
        self._close_block(call)
        self._buffer = self._buffer[end + len(self.END) :]
        return True

    def _feed_call(self, call: _Call, upto: int, out: list[ToolEvent]) -> None:
        call.feed(self._buffer[self._num_fed : upto], 0, out)
        self._num_fed = upto

    def _close_block(self, call: _Call) -> None:
        self._num_calls += call.is_started
        self._call = None

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        call = self._call
        if call is None:
            if self._buffer and not self._has_block:
                out.append(Content(self._buffer))
        else:
            self._feed_call(call, len(self._buffer), out)
            if not call.is_started:
                out.append(Content(self.START + self._buffer))
            self._close_block(call)
        self._buffer = ""
        return out


class Llama3JsonParser:
    """Llama 3.1/3.2 JSON tool calls: the reply is one or more `{"name", "parameters"}` objects
    (separated by `;`), optionally after `<|python_tag|>`. A reply that does not start with `{` is
    content; so is one whose first object is not a call, or names a function the request did not
    offer (`tool_names`): a JSON answer such as `{"name": "Ada", "age": 36}` is an answer. Text
    after the calls is dropped."""

    TAG = "<|python_tag|>"

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._reply = ""  # the reply so far, while it may still be content
        self._mode = "undecided"  # then "content" or "calls"
        self._calls = _CallSequence(" \t\r\n;", tool_names)

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._mode == "content":
            return [Content(text)] if text else out
        if self._mode == "calls":
            if self._calls.num_calls == 0:
                self._reply += text
            self._calls.feed(text, 0, out)
        else:
            self._reply += text
            body = self._calls_start()
            if body is None:
                return [Content(self._reply)] if self._mode == "content" else out
            self._mode = "calls"
            self._calls.feed(self._reply, len(self._reply) - len(body), out)
        if self._calls.num_calls == 0 and self._calls.is_over:  # the first object is not a call
            self._mode = "content"
            out.append(Content(self._reply))
        if self._calls.num_calls:
            self._reply = ""
        return out

    def _calls_start(self) -> str | None:
        """The reply from its first `{` if it is a call list; None while undecided. Decides
        "content" when it cannot be one."""
        body = self._reply.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
            if not body:
                return None
        elif not body or self.TAG.startswith(body):
            return None
        if body.startswith("{"):
            return body
        self._mode = "content"
        return None

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._mode != "content" and self._calls.num_calls == 0 and self._reply:
            out.append(Content(self._reply))
        self._mode, self._reply = "content", ""
        return out


_MISTRAL_SKIPPED = re.compile(r"[ \t\r\n,\]]*")  # between calls: white space, `,`, an array's end
# a name, then optionally `[CALL_ID]id` and `[ARGS]` (special tokens: the text may lack them)
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(\[CALL_ID\][A-Za-z0-9]*)?(\[ARGS\])?")
_MISTRAL_TAGS = ("[CALL_ID]", "[ARGS]")
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
        self._call: _Call | None = None
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
        skipped = _MISTRAL_SKIPPED.match(text, i)
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
            self._call = _Call(self.num_calls, self.names)
            return i
        return self._named_call(text, i, is_final)

    def _named_call(self, text: str, i: int, is_final: bool) -> int | None:
        match = _MISTRAL_NAMED.match(text, i)
        end = i if match is None else match.end()
        is_long = match is not None and len(match.group(1)) > _MAX_NAME_CHARS  # no name: stop reading
        if not (is_final or is_long) and (
            end == len(text) or any(t.startswith(text[end:]) for t in _MISTRAL_TAGS)
        ):
            return None
        name = None if match is None else match.group(1)
        has_args = match is not None and match.group(3) is not None
        is_offered = self.names is None or name in self.names
        # without its [ARGS] tag, a name is a call only if an object follows it at once
        if name is None or is_long or not is_offered or not (has_args or text.startswith("{", end)):
            self.is_over = True
            return end
        self._call = _Call(self.num_calls, None, CallScanner.arguments_of(name))
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
    These markers are special tokens, which the engine leaves out of returned text, so a reply
    that opens with calls without them (`[{"name": ...}]`, or `name{...}`) is read as calls too
    when its first call names a function in `tools`; otherwise such a reply is content."""

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
        cut = start if start != -1 else len(self._reply) - _held_back(self._reply, _MistralCalls.MARKER)
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


def default_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """A call id as Mistral's chat templates require (they refuse others): 9 letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


class RequiredListParser:
    """What `tool_choice: "required"` makes the model write: a JSON array of
    `{"name", "parameters"}` objects (the grammar guarantees the shape). Never content."""

    def __init__(self) -> None:
        self._is_open = False  # the array's `[` was read
        self._calls = _CallSequence(" \t\r\n,")

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        start = 0
        if not self._is_open:
            start = text.find("[") + 1
            if start == 0:
                return out
            self._is_open = True
        self._calls.feed(text, start, out)
        return out

    def finish(self) -> list[ToolEvent]:
        return []  # a call cut off is sent as far as it was written


class FirstCallOnly:
    """A parser's events up to its first call's end: what `parallel_tool_calls: false` promises
    (one call at most) when nothing constrains the reply. Later calls are dropped; content is
    kept (the parsers send it only before a reply's first call)."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser

    def feed(self, text: str) -> list[ToolEvent]:
        return self._first_call(self._parser.feed(text))

    def finish(self) -> list[ToolEvent]:
        return self._first_call(self._parser.finish())

    @staticmethod
    def _first_call(events: list[ToolEvent]) -> list[ToolEvent]:
        return [e for e in events if isinstance(e, Content) or e.index == 0]


TOOL_PARSERS: dict[str, ToolParserClass] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}

CALL_IDS: dict[str, Callable[[], str]] = {"mistral": mistral_call_id}  # else default_call_id
