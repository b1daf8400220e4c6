"""Pythonic tool calls (`--tool-call-parser pythonic`, Llama 3.2 / Llama 4 / ToolACE): the reply is
a Python list of calls, `[get_weather(city="Paris", days=3), get_time()]`, whose keyword arguments
are Python literals. Each call is read with `ast` (never evaluated) once its parenthesis closes."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Collection

from corral_engine.server.tool_events import ArgumentsDelta, CallStart, Content, ToolEvent

_WS = re.compile(r"\s*")
_CALL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\(")  # a call's name and its opening parenthesis
_NAME_SO_FAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")  # what may still become one
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _skip_ws(text: str, i: int) -> int:
    match = _WS.match(text, i)
    return i if match is None else match.end()


class _CallSpan:
    """Where one call's text `name(...)` ends: brackets are counted outside string literals (single,
    double or triple quoted, with escapes), so `)` in `q="a)"` does not end it."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start  # read up to here
        self._stack: list[str] = []  # open brackets
        self._quote = ""  # the open string's quote: one or three of ' or "
        self._is_escaped = False
        self.is_broken = False  # a bracket closed the wrong kind: no call can parse

    def end(self, text: str) -> int | None:
        """The index after the call's closing parenthesis, once read; None while it is open."""
        i, n = self._pos, len(text)
        while i < n:
            c = text[i]
            if self._quote:
                if self._is_escaped:
                    self._is_escaped = False
                elif c == "\\":
                    self._is_escaped = True
                elif text.startswith(self._quote, i):
                    i += len(self._quote) - 1
                    self._quote = ""
                elif len(self._quote) == 3 and self._quote.startswith(text[i:]):
                    break  # maybe the closing triple quote: wait for the rest
            elif c in "'\"":
                if n - i < 3 and text[i:] == c * (n - i):
                    break  # a string or a triple-quoted one: the next characters tell
                self._quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self._quote) - 1
            elif c in "([{":
                self._stack.append(c)
            elif c in _CLOSERS:
                if not self._stack or self._stack.pop() != _CLOSERS[c]:
                    self.is_broken = True
                    return i + 1
                if not self._stack:
                    return i + 1
            i += 1
        self._pos = i
        return None


def call_of(source: str) -> tuple[str, str] | None:
    """`name(key=literal, ...)` as (name, JSON arguments); None for anything else (positional
    arguments, values that are not literals or have no JSON form)."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    try:
        for keyword in node.keywords:
            if keyword.arg is None:  # **mapping
                return None
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        # tuples become arrays; sets, bytes, complex numbers and inf/nan have no JSON form
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


class PythonicParser:
    """A reply that opens with `[name(` is read as a list of calls; any other reply is content. Each
    call is sent (its name, then its arguments as one JSON object) once its closing parenthesis is
    read and it parses as a call with literal keyword arguments. The first call decides: if it does
    not parse, or the reply ends before it closes, the whole reply is content (as vLLM's, whose
    parser requires the reply to be such a list). A later call that does not parse, and anything
    after it or after the list's `]`, is dropped. `tool_names` is not consulted (nor by vLLM)."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._text = ""  # unread text; the whole reply until its first call is read
        self._pos = 0  # of _text, what has been read
        self._expect = "open"  # "open" (the list's `[`), "call", "comma"; "over"; "content"
        self._span: _CallSpan | None = None  # the call being read
        self._num_calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._expect == "content":
            return [Content(text)] if text else out
        if self._expect == "over":
            return out
        self._text += text
        while self._advance(out):
            pass
        return out

    def _advance(self, out: list[ToolEvent]) -> bool:
        """Read what can be decided; True when something was and there may be more."""
        if self._expect in ("content", "over"):
            return False
        if self._span is not None:
            return self._read_call(self._span, out)
        i = _skip_ws(self._text, self._pos)
        if i == len(self._text):
            return False
        c = self._text[i]
        if self._expect == "open":
            self._pos, self._expect = i + 1, "call"
            return c == "[" or self._refuse(out)
        if self._expect == "comma":
            if c != ",":
                self._expect = "over"  # `]`, or anything else: the list is over
                return False
            self._pos, self._expect = i + 1, "call"
            return True
        if c == "]" and self._num_calls:  # a trailing comma
            self._expect = "over"
            return False
        if _CALL_NAME.match(self._text, i):
            self._span = _CallSpan(i)
            return True
        if _NAME_SO_FAR.match(self._text, i):
            return False  # a name being written
        return self._refuse(out)

    def _read_call(self, span: _CallSpan, out: list[ToolEvent]) -> bool:
        end = span.end(self._text)
        if end is None:
            return False
        self._span = None
        call = None if span.is_broken else call_of(self._text[span.start : end])
        if call is None:
            return self._refuse(out)
        name, arguments = call
        out += [CallStart(self._num_calls, name), ArgumentsDelta(self._num_calls, arguments)]
        self._num_calls += 1
        self._text, self._pos, self._expect = self._text[end:], 0, "comma"
        return True

    def _refuse(self, out: list[ToolEvent]) -> bool:
        """What is read is no call: before the first call the reply is content, after it the list
        is over. Returns False (nothing more to read)."""
        if self._num_calls:
            self._expect = "over"
        else:
            self._expect = "content"
            if self._text:
                out.append(Content(self._text))
        self._text = ""
        return False

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._expect not in ("content", "over"):
            self._refuse(out)  # undecided, or a call left open: as if it could not parse
        self._expect, self._text, self._span = "over", "", None
        return out
