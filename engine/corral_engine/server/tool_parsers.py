"""Tool calls parsed out of generated text (`--tool-call-parser`), as the text streams.

A parser is fed a reply's text in pieces and answers with events: content, the start of a call
(its name, as soon as the name's string closes), and pieces of that call's arguments (the model's
own text of them, as it is written). A whole reply is one feed, so a stream's events add up to the
whole reply's, however the text was split. Content that could still start a call's marker is held
back until it cannot; text inside a call is never content. A call is a call once it is named,
whatever follows (a reply cut off by max_tokens ends with a call whose arguments are cut off too);
a pythonic call is one once its parenthesis closes and it parses.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from corral_engine.server.tool_events import (
    ArgumentsDelta,
    CallReader,
    CallStart,
    Content,
    ToolEvent,
    ToolParser,
    ToolSchemas,
    held_back,
)
from corral_engine.server.tool_parser_mistral import MISTRAL_MARKERS, MistralParser, mistral_call_id
from corral_engine.server.tool_parser_pythonic import PythonicParser
from corral_engine.server.tool_parser_qwen3_coder import Qwen3CoderParser

__all__ = ["ArgumentsDelta", "CallStart", "Content", "ToolEvent", "ToolParser"]  # read from here too


class ToolParserClass(Protocol):
    """A parser for a request offering the functions `tools` (None: any name)."""

    def __call__(self, tools: ToolSchemas | None = None, /) -> ToolParser: ...


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


class _CallSequence:
    """Call objects one after another with `separators` between them. Anything else, or an
    object that is not a call (or names none of `names`, where given), ends the sequence
    (`is_over`)."""

    def __init__(self, separators: str, names: Collection[str] | None = None) -> None:
        self.separators = separators
        self.names = names
        self.is_over = False
        self._num_done = 0  # calls read to their end
        self._call: CallReader | None = None

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
                self._call = CallReader(self._num_done, self.names)
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
        self._call: CallReader | None = None  # inside a block
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
            cut = start if start != -1 else len(self._buffer) - held_back(self._buffer, self.START)
            if cut and not self._has_block:
                out.append(Content(self._buffer[:cut]))
            if start == -1:
                self._buffer = self._buffer[cut:]
                return False
            self._buffer = self._buffer[start + len(self.START) :]
            self._call, self._num_fed, self._has_block = CallReader(self._num_calls), 0, True
            return True
        call = self._call
        end = self._buffer.find(self.END, self._num_fed)
        # Text that may be the start of END is not fed to the call until it is known not to be.
        safe = end if end != -1 else len(self._buffer) - held_back(self._buffer, self.END)
        self._feed_call(call, max(safe, self._num_fed), out)
        if end == -1:
            return False
        self._close_block(call)
        self._buffer = self._buffer[end + len(self.END) :]
        return True

    def _feed_call(self, call: CallReader, upto: int, out: list[ToolEvent]) -> None:
        call.feed(self._buffer[self._num_fed : upto], 0, out)
        self._num_fed = upto

    def _close_block(self, call: CallReader) -> None:
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


def default_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


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
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}

CALL_IDS: dict[str, Callable[[], str]] = {"mistral": mistral_call_id}  # else default_call_id
# Special tokens a parser reads, which the reply's text must show (the engine leaves them out else).
MARKER_TOKENS: dict[str, tuple[str, ...]] = {"mistral": MISTRAL_MARKERS}
