"""The pythonic and qwen3_coder parsers beyond the recorded replies of test_tool_parsers: qwen3_coder
types each value by the request's tool schema (as vLLM converts them, whole and streamed in any
chunking), pythonic sends a call whole once its parenthesis closes, and every call either parser
sends has JSON arguments."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from corral_engine.server.api_tools import Tool, plan_tools
from corral_engine.server.tool_calls import ReplyStream, reply_message
from corral_engine.server.tool_parser_qwen3_coder import convert_value
from corral_engine.server.tool_parsers import (
    TOOL_PARSERS,
    ArgumentsDelta,
    CallStart,
    Content,
    collect,
    parse_whole,
)

from tests.server.test_tool_parsers import RECORDED

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "where": {"type": "object"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "limit": {"type": ["integer", "null"]},
    },
}
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "forecast", "parameters": PARAMETERS}}),
    Tool.model_validate({"type": "function", "function": {"name": "get_time"}}),
]


def _qwen3(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (value as written, its parameter, the JSON value vLLM makes of it)
CONVERSIONS: list[tuple[str, str, Any]] = [
    ("Paris", "city", "Paris"),
    ("3", "city", "3"),  # a string stays a string
    ("null", "city", "null"),  # ... even null, unless the schema admits null
    ("3", "days", 3),
    ("three", "days", "three"),  # not an integer: the text, as vLLM leaves it
    ("2.5", "ratio", 2.5),
    ("2.0", "ratio", 2),  # whole numbers are integers
    ("1e999", "ratio", "1e999"),  # JSON has no infinity
    ("True", "metric", True),
    ("yes", "metric", False),  # not true/false: false, as vLLM
    ('{"lat": 48.9, "tags": ["a"]}', "where", {"lat": 48.9, "tags": ["a"]}),
    ("{'lat': 48.9}", "where", {"lat": 48.9}),  # a Python literal where JSON fails
    ("[9, 17]", "hours", [9, 17]),
    ("{1, 2}", "hours", "{1, 2}"),  # a set: no JSON form, the text
    ("not json", "where", "not json"),
    ("None", "note", None),
    ("soon", "note", "soon"),
    ("null", "limit", None),
    ("10", "limit", 10),
    ("anything", "undeclared", "anything"),  # a parameter the tool does not declare: a string
]


@pytest.mark.parametrize(("text", "parameter", "value"), CONVERSIONS)
def test_qwen3_coder_values_take_their_schema_type(text: str, parameter: str, value: Any) -> None:
    assert convert_value(text, PARAMETERS["properties"].get(parameter)) == value  # type: ignore[attr-defined]


def _chunkings(text: str, seed: int) -> Iterator[list[str]]:
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(1, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _streamed(plan: Any, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    reply = ReplyStream(plan)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        for delta in reply.feed(piece, is_final=i == len(pieces) - 1):
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name", "")
                entry[1] += call["function"]["arguments"]
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def test_qwen3_coder_reply_is_typed_by_the_requests_tools_whole_and_streamed() -> None:
    plan = plan_tools(TOOLS, "auto", True, "qwen3_coder")
    written = {"city": "Paris", "days": "3", "metric": "false", "hours": "[9, 17]", "limit": "null"}
    text = "Checking.\n" + _qwen3("forecast", written) + "\n" + _qwen3("get_time", {"tz": "UTC"})
    message = reply_message(plan, text)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert message["content"] == "Checking.\n"
    assert calls == [
        ("forecast", {"city": "Paris", "days": 3, "metric": False, "hours": [9, 17], "limit": None}),
        ("get_time", {"tz": "UTC"}),
    ]
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    for pieces in _chunkings(text, seed=5):
        assert _streamed(plan, pieces) == ("Checking.\n", whole), pieces
    one = plan_tools(TOOLS, "auto", False, "qwen3_coder")  # parallel_tool_calls false: the first
    assert _streamed(one, [text[:40], text[40:]]) == ("Checking.\n", whole[:1])


def test_qwen3_coder_streams_each_value_once_it_ends() -> None:
    parser = TOOL_PARSERS["qwen3_coder"]({"forecast": PARAMETERS})
    assert parser.feed("Hi <tool_call>\n<function=forecast>\n<parameter=city>\nPar") == [
        Content("Hi "),
        CallStart(0, "forecast"),
    ]
    assert parser.feed("is\n</parameter>\n<parameter=days>\n4\n</param") == [
        ArgumentsDelta(0, '{"city": "Paris"')
    ]
    assert parser.feed("eter>\n</function>\n</tool_call>") == [
        ArgumentsDelta(0, ', "days": 4'),
        ArgumentsDelta(0, "}"),
    ]
    assert parser.finish() == []


def test_pythonic_sends_each_call_once_its_parenthesis_closes() -> None:
    parser = TOOL_PARSERS["pythonic"]()
    assert parser.feed('[get_weather(city="Paris)",') == []  # inside a string: not closed yet
    assert parser.feed(" days=3), get_ti") == [
        CallStart(0, "get_weather"),
        ArgumentsDelta(0, '{"city": "Paris)", "days": 3}'),
    ]
    assert parser.feed("me()]") == [CallStart(1, "get_time"), ArgumentsDelta(1, "{}")]
    assert parser.finish() == []
    content = TOOL_PARSERS["pythonic"]()
    assert content.feed("[1") == [Content("[1")]  # cannot be a call: sent at once
    assert content.feed(", 2]") == [Content(", 2]")]


@pytest.mark.parametrize(
    ("name", "text"), [(n, t) for n, t, _ in RECORDED if n in ("pythonic", "qwen3_coder")]
)
def test_every_call_has_json_arguments(name: str, text: str) -> None:
    for call in parse_whole(TOOL_PARSERS[name], text).calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_pythonic_never_evaluates_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    def _called(*_: Any) -> None:
        raise AssertionError("the reply was run")

    make = TOOL_PARSERS["pythonic"]
    text = '[get_time(tz=__import__("os").getenv("HOME"))]'
    monkeypatch.setattr("builtins.__import__", _called)  # evaluation would import os
    try:
        parsed = parse_whole(make, text)
    finally:
        monkeypatch.undo()
    assert parsed == collect([Content(text)])
