"""Tool calls parsed out of generated text (`--tool-call-parser`), whole or as it streams.

A parser reads the text so far and says which leading part is certainly content and which calls
are complete. Streaming feeds the growing text and sends only what is new, so a stream's content
and calls are the same as parsing the whole text at once, however the text was chunked. Content
that could still be the start of a call's marker is held back until it cannot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str  # only ever grows as the text does (a stream sends the difference)
    calls: list[ParsedCall]


class ToolParser(Protocol):
    def parse(self, text: str, is_final: bool) -> Parsed: ...


def _call(value: Any, args_key: str) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(args_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """Hermes / Qwen 2.5 and 3: content, then `<tool_call>{"name", "arguments"}</tool_call>` blocks.
    Content is what precedes the first block. A block whose JSON is not a call is dropped; an
    unclosed block at the end is parsed if it holds a whole call and is content otherwise."""

    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, is_final: bool) -> Parsed:
        first = text.find(self.START)
        if first == -1:
            cut = len(text) if is_final else len(text) - _held_back(text, self.START)
            return Parsed(text[:cut], [])
        content, calls = text[:first], []
        pos = first
        while pos != -1:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:] if end == -1 else text[body_start:end]
            if end == -1 and not is_final:
                break
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
            elif end == -1:
                content += text[pos:]
            if end == -1:
                break
            pos = text.find(self.START, end + len(self.END))
        return Parsed(content, calls)


class Llama3JsonParser:
    """Llama 3.1/3.2 JSON tool calls: the reply is one or more `{"name", "parameters"}` objects
    (separated by `;`), optionally after `<|python_tag|>`. A reply that does not start with `{` is
    content; one that does but holds no call is content at the end."""

    TAG = "<|python_tag|>"

    def parse(self, text: str, is_final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        elif not is_final and (not body or self.TAG.startswith(body)):
            return Parsed("", [])  # could still become a call
        if not body.startswith("{"):
            return Parsed(text if is_final or body else "", [])
        calls, pos = [], 0
        while pos < len(body):
            try:
                value, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                break  # an object still being written (or garbage)
            call = _call(value, "parameters")
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        if is_final and not calls:
            return Parsed(text, [])
        return Parsed("", calls)


class RequiredListParser:
    """What `tool_choice: "required"` makes the model write: a JSON array of
    `{"name", "parameters"}` objects (the grammar guarantees the shape)."""

    def parse(self, text: str, is_final: bool) -> Parsed:
        calls: list[ParsedCall] = []
        pos = text.find("[")
        if pos == -1:
            return Parsed("", calls)
        pos += 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            try:
                value, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                break
            call = _call(value, "parameters")
            if call is None:
                break
            calls.append(call)
        return Parsed("", calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
