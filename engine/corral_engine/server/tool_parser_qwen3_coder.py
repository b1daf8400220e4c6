"""Qwen3-Coder's XML tool calls (`--tool-call-parser qwen3_coder`): content, then
`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`
blocks. A value is text, turned into the JSON type the request's tool schema gives its parameter."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from corral_engine.server.tool_events import (
    ArgumentsDelta,
    CallStart,
    Content,
    ToolEvent,
    ToolSchemas,
    held_back,
)

TOOL_CALL, FUNCTION, PARAMETER = "<tool_call>", "<function=", "<parameter="
PARAMETER_END, FUNCTION_END = "</parameter>", "</function>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)  # a value ends at the first of these
_BAD_NAME = re.compile(r"[{}<>\"'\s]")  # a name with these is a template or prose, not a call
_MAX_NAME_CHARS = 256  # a tag's name unclosed for longer is no name
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_BOOLEAN_TYPES = frozenset({"boolean", "bool", "binary"})


def _schema_type(schema: Any) -> tuple[str, bool]:
    """A parameter schema's type (its first non-null one, from `type` or `anyOf`; "string" where
    none is given) and whether it admits null."""
    if not isinstance(schema, Mapping):
        return "string", False
    given = schema.get("type")
    if given is None and isinstance(schema.get("anyOf"), list):
        given = [option.get("type") for option in schema["anyOf"] if isinstance(option, Mapping)]
    types = [str(t).strip().lower() for t in (given if isinstance(given, list) else [given]) if t]
    kinds = [t for t in types if t != "null"]
    return (kinds[0] if kinds else "null" if types else "string"), "null" in types


def _has_json_form(value: Any) -> bool:
    """Whether JSON can write `value` (no sets, bytes, complex numbers, inf or nan)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for, as vLLM converts it: a
    value that does not convert stays a string (a boolean that is not true/false is false)."""
    if schema is None:  # a parameter the tool does not declare
        return text
    kind, is_nullable = _schema_type(schema)
    if text.lower() in ("null", "none") and (is_nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in _BOOLEAN_TYPES:
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            pass
    try:  # other types, and containers written as Python literals
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return text
    return value if _has_json_form(value) else text


class Qwen3CoderParser:
    """Content is what precedes the first `<tool_call>` (or `<function=`, which some replies lack
    the block tag for). Then each `<function=NAME>` is a call, named when its `>` is read; each
    parameter's value is sent (`{"p": value`, then `, "q": value`) once it ends, at `</parameter>`
    (or the next `<parameter=` or `</function>`, where the model left it out), and `}` at
    `</function>`. One leading and one trailing newline of a value are the format's, not the
    value's. Text between calls is dropped. A reply cut off inside a call closes it (arguments JSON,
    the last value as far as written); one with no call named is content throughout."""

    def __init__(self, tools: ToolSchemas | None = None) -> None:
        self._tools = tools or {}
        self._buffer = ""  # unread text
        self._state = "content"  # then "between", "name", "body", "parameter", "value"
        self._skipped = ""  # the reply from its first marker on, while no call has started
        self._num_calls = 0
        self._properties: Mapping[str, Any] = {}  # the current call's parameter schemas
        self._parameter = ""  # the parameter being read
        self._value = ""
        self._num_values = 0  # of the current call, sent

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self._buffer += text
        if not self._num_calls and self._state != "content":
            self._skipped += text
        while self._advance(out):
            pass
        return out

    def _advance(self, out: list[ToolEvent]) -> bool:
        """Read what can be decided in the current state; True when it changed."""
        state = self._state
        if state == "content":
            return self._read_content(out)
        if state == "between":
            return self._find(FUNCTION, "name")
        if state in ("name", "parameter"):
            return self._read_name(out)
        if state == "body":
            return self._read_body(out)
        return self._read_value(out)

    def _read_content(self, out: list[ToolEvent]) -> bool:
        starts = [at for at in (self._buffer.find(TOOL_CALL), self._buffer.find(FUNCTION)) if at != -1]
        start = min(starts, default=-1)
        keep = max(held_back(self._buffer, TOOL_CALL), held_back(self._buffer, FUNCTION))
        cut = start if start != -1 else len(self._buffer) - keep
        if cut:
            out.append(Content(self._buffer[:cut]))
        self._buffer = self._buffer[cut:]
        if start == -1:
            return False
        self._state, self._skipped = "between", self._buffer
        return True

    def _find(self, marker: str, then: str) -> bool:
        """Skip to after `marker`, then be in state `then`; what may start it is kept."""
        at = self._buffer.find(marker)
        if at == -1:
            self._buffer = self._buffer[len(self._buffer) - held_back(self._buffer, marker) :]
            return False
        self._buffer, self._state = self._buffer[at + len(marker) :], then
        return True

    def _read_name(self, out: list[ToolEvent]) -> bool:
        """A function's or a parameter's name, up to its `>`."""
        end = self._buffer.find(">")
        if end == -1 and len(self._buffer) <= _MAX_NAME_CHARS:
            return False
        name = self._buffer[:end].strip() if end != -1 else ""
        is_function = self._state == "name"
        if not name or _BAD_NAME.search(name):  # not a call: look for the next one
            self._state = "between" if is_function else "body"
            self._buffer = self._buffer[max(end, 0) :] if not is_function else self._buffer
            return True
        self._buffer = self._buffer[end + 1 :]
        if not is_function:
            self._parameter, self._value, self._state = name, "", "value"
            return True
        schema = self._tools.get(name)
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        self._properties = properties if isinstance(properties, Mapping) else {}
        out.append(CallStart(self._num_calls, name))
        self._num_calls, self._skipped = self._num_calls + 1, ""
        self._num_values, self._state = 0, "body"
        return True

    def _read_body(self, out: list[ToolEvent]) -> bool:
        """Between a call's parameters: the next `<parameter=` or the `</function>` that ends it."""
        at = {marker: self._buffer.find(marker) for marker in (PARAMETER, FUNCTION_END)}
        found = [(i, marker) for marker, i in at.items() if i != -1]
        if not found:
            keep = max(held_back(self._buffer, marker) for marker in at)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        i, marker = min(found)
        self._buffer = self._buffer[i + len(marker) :]
        if marker == PARAMETER:
            self._state = "parameter"
        else:
            self._close_call(out)
        return True

    def _read_value(self, out: list[ToolEvent]) -> bool:
        ends = [(at, marker) for marker in _VALUE_ENDS if (at := self._buffer.find(marker)) != -1]
        if not ends:
            keep = max(held_back(self._buffer, marker) for marker in _VALUE_ENDS)
            self._value += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        at, marker = min(ends)
        self._value += self._buffer[:at]
        # `</parameter>` is the value's; a `<parameter=` or `</function>` read in its place is the body's
        self._buffer = self._buffer[at + len(marker) :] if marker == PARAMETER_END else self._buffer[at:]
        self._send_value(out)
        self._state = "body"
        return True

    def _send_value(self, out: list[ToolEvent]) -> None:
        text = self._value
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        value = convert_value(text, self._properties.get(self._parameter))
        key = json.dumps(self._parameter, ensure_ascii=False)
        piece = f"{key}: {json.dumps(value, ensure_ascii=False)}"
        out.append(ArgumentsDelta(self._num_calls - 1, ("{" if not self._num_values else ", ") + piece))
        self._num_values += 1
        self._value = ""

    def _close_call(self, out: list[ToolEvent]) -> None:
        out.append(ArgumentsDelta(self._num_calls - 1, "}" if self._num_values else "{}"))
        self._state = "between"

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        state = self._state
        if state == "content":
            if self._buffer:
                out.append(Content(self._buffer))
        elif state == "value":  # cut off inside a value: it is as far as written
            self._value += self._buffer
            self._send_value(out)
            self._close_call(out)
        elif state in ("body", "parameter"):
            self._close_call(out)
        if not self._num_calls and self._skipped:
            out.append(Content(self._skipped))
        self._buffer, self._skipped, self._state = "", "", "between"
        return out
