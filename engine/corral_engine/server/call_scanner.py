"""One tool call's JSON object (`{"name": ..., "arguments": {...}}`) read as its text arrives.

The scanner tracks only the object's structure: which key a value belongs to and where each value
ends. The name is known once its string closes; the arguments are the model's own text of their
value, handed out piece by piece as it is read, so a client can render them as they stream. Reading
is the same however the text is split (a state machine over characters; runs without structure
are skipped with regular expressions, so a long reply costs one pass).
"""

from __future__ import annotations

import json
import re
from enum import Enum, auto

_WS = re.compile(r"[ \t\r\n]*")
_STRING_RUN = re.compile(r'[^"\\]*')  # inside a string, up to a quote or an escape
_CONTAINER_RUN = re.compile(r'[^"{}\[\]]*')  # inside an object or array, up to structure
_SCALAR_RUN = re.compile(r"[^,}\]\s]*")  # a number, true, false or null, up to its end
_VALUE_STARTS = frozenset('{["-0123456789tfn')
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and OpenAI say arguments, Llama 3 parameters
NO_ARGUMENTS = "{}"  # what a call without an arguments key gets


class _State(Enum):
    OPEN = auto()  # before the object's `{`
    KEY = auto()  # before a key (or the closing `}`)
    IN_KEY = auto()
    COLON = auto()
    VALUE = auto()  # before a value
    IN_VALUE = auto()
    AFTER_VALUE = auto()  # before `,` or `}`
    DONE = auto()  # the object closed
    FAILED = auto()  # not a JSON object; everything after is ignored


class _Role(Enum):
    NAME = auto()
    ARGUMENTS = auto()
    OTHER = auto()


class CallScanner:
    """Reads one call object. `feed(text, start)` reads from `start` and returns where the object
    stopped taking characters (the end of `text` until the object closes). `name` is set once
    known; `take_arguments` hands out the arguments' text read since the last take. Arguments
    written as a JSON string (some models do) are decoded and handed out whole once it closes."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.has_arguments = False  # an arguments value has started
        self._state = _State.OPEN
        self._role = _Role.OTHER
        self._raw = ""  # the key, name or string arguments being read, quotes included
        self._key: str | None = None  # the key whose value is being read
        self._arguments = ""  # read but not yet taken
        # the value being read: a string, a container (with its depth) or a scalar
        self._kind = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._is_bare = False  # reads an arguments value alone (see arguments_of)

    @classmethod
    def arguments_of(cls, name: str) -> CallScanner:
        """A scanner for a call named before its arguments (Mistral's `name[ARGS]{...}`): it reads
        the arguments value alone and is done where that value ends, taking nothing after it."""
        scanner = cls()
        scanner.name = name
        scanner._key = "arguments"
        scanner._state = _State.VALUE
        scanner._is_bare = True
        return scanner

    @property
    def is_done(self) -> bool:
        return self._state is _State.DONE

    @property
    def is_failed(self) -> bool:
        return self._state is _State.FAILED

    def take_arguments(self) -> str:
        taken, self._arguments = self._arguments, ""
        return taken

    def feed(self, text: str, start: int = 0) -> int:
        i, n = start, len(text)
        while i < n and self._state not in (_State.DONE, _State.FAILED):
            i = self._step(text, i)
        return i

    def _step(self, text: str, i: int) -> int:
        """Advance from `text[i]` through at most one state; returns the next position."""
        state = self._state
        if state is _State.IN_KEY:
            return self._read_key(text, i)
        if state is _State.IN_VALUE:
            return self._read_value(text, i)
        i = _skip(_WS, text, i)
        if i == len(text):
            return i
        c = text[i]
        if state is _State.OPEN:
            self._state = _State.KEY if c == "{" else _State.FAILED
        elif state is _State.KEY:
            self._state = {'"': _State.IN_KEY, "}": _State.DONE}.get(c, _State.FAILED)
            self._raw, self._escape = c, False
        elif state is _State.COLON:
            self._state = _State.VALUE if c == ":" else _State.FAILED
        elif state is _State.AFTER_VALUE:
            self._state = {",": _State.KEY, "}": _State.DONE}.get(c, _State.FAILED)
        else:  # VALUE: starts at c, which the value reader consumes
            return self._start_value(text, i)
        if self._state is _State.DONE and not self.has_arguments:
            self.has_arguments = True
            self._arguments += NO_ARGUMENTS
        return i + 1

    def _read_key(self, text: str, i: int) -> int:
        end, closed = self._read_string(text, i)
        self._raw += text[i:end]
        if closed:
            self._key = _decode(self._raw)
            self._state = _State.COLON
        return end

    def _start_value(self, text: str, i: int) -> int:
        c = text[i]
        if c not in _VALUE_STARTS:
            self._state = _State.FAILED
            return i
        key = self._key
        if key == "name" and self.name is None:
            self._role = _Role.NAME
        elif key in ARGUMENT_KEYS and not self.has_arguments:
            self._role = _Role.ARGUMENTS
            self.has_arguments = True
        else:
            self._role = _Role.OTHER
        self._kind = "string" if c == '"' else "container" if c in "{[" else "scalar"
        self._depth = 0  # a container is read from its opening bracket
        self._in_string = self._escape = False
        self._raw = ""
        self._state = _State.IN_VALUE
        if self._kind == "string":
            self._collect(c)
            return i + 1
        return i  # containers and scalars are read from their first character

    def _read_value(self, text: str, i: int) -> int:
        if self._kind == "string":
            end, closed = self._read_string(text, i)
        elif self._kind == "container":
            end, closed = self._read_container(text, i)
        else:
            end = _skip(_SCALAR_RUN, text, i)
            closed = end < len(text)  # the character after a scalar is not part of it
        self._collect(text[i:end])
        if closed:
            self._end_value()
        return end

    def _collect(self, piece: str) -> None:
        if self._role is _Role.ARGUMENTS and self._kind != "string":
            self._arguments += piece
        elif self._role is not _Role.OTHER:
            self._raw += piece

    def _end_value(self) -> None:
        self._state = _State.DONE if self._is_bare else _State.AFTER_VALUE
        if self._kind != "string" or self._role is _Role.OTHER:
            return
        value = _decode(self._raw)
        if self._role is _Role.NAME:
            self.name = value
        elif value is not None:
            self._arguments += value

    def _read_string(self, text: str, i: int) -> tuple[int, bool]:
        """Read a string's characters from `i` (the opening quote already read); (end, closed)."""
        n = len(text)
        while i < n:
            if self._escape:
                self._escape = False
                i += 1
                continue
            i = _skip(_STRING_RUN, text, i)
            if i == n:
                break
            if text[i] == "\\":
                self._escape = True
                i += 1
            else:
                return i + 1, True
        return i, False

    def _read_container(self, text: str, i: int) -> tuple[int, bool]:
        n = len(text)
        while i < n:
            if self._in_string:
                i, closed = self._read_string(text, i)
                self._in_string = not closed
                continue
            i = _skip(_CONTAINER_RUN, text, i)
            if i == n:
                break
            c = text[i]
            i += 1
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return i, True
        return i, False


def _skip(run: re.Pattern[str], text: str, i: int) -> int:
    """The end of the run of `run`'s characters at `i` (the patterns match the empty run too)."""
    match = run.match(text, i)
    return i if match is None else match.end()


def _decode(literal: str) -> str | None:
    """A JSON string literal's value; None for a malformed one."""
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None
