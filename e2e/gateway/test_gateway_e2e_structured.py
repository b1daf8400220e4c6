"""Issue 23, acceptance 1: structured outputs and tool calls with the official openai client on a
random-weight demo model, straight to `corral engine` and through `corral gateway`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from e2e.gateway.conftest import MODEL, start_gateway
from e2e.procs import EngineProcess, ManagedProcess, start_engine

pytestmark = pytest.mark.e2e

ASK: Any = [{"role": "user", "content": "Give me a record."}]
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    with start_engine(tiny_model_dir, served_model_name=MODEL, tool_call_parser="hermes") as e:
        yield e


@pytest.fixture(scope="module")
def gateway(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_gateway({MODEL: [engine.url]}, tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


@pytest.fixture(params=["direct", "gateway"])
def client(request: pytest.FixtureRequest, engine: EngineProcess) -> openai.OpenAI:
    url = engine.url if request.param == "direct" else request.getfixturevalue("gateway").url
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_and_json_object(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, max_tokens=80, seed=seed
        )
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), RECORD)
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, max_tokens=80, seed=seed, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), RECORD)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=200, seed=0
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_choice_and_regex_on_chat_and_completions(client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue"]
    for seed in range(2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=10,
            seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert r.choices[0].message.content in choices
        c = client.completions.create(
            model=MODEL, prompt="Date:", max_tokens=20, seed=seed,
            extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
        )  # fmt: skip
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", c.choices[0].text)


def test_tool_calls(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60
    )
    assert r.choices[0].finish_reason == "tool_calls"
    call = (r.choices[0].message.tool_calls or [])[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        parallel_tool_calls=False,
    )
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls or []) >= 1
    for c in r.choices[0].message.tool_calls or []:
        assert c.function.name == "get_weather"
        jsonschema.validate(json.loads(c.function.arguments), WEATHER)
    function = {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}
    history: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "-3 and snowing"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].message.role == "assistant"


def _accumulate(stream: Any) -> tuple[str, dict[int, dict[str, str]], list[str]]:
    """What an openai client user builds from streamed deltas: content, calls by index, finishes."""
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.function and delta.function.name:  # a call's first delta: before its arguments
                    assert not call["arguments"] and delta.function.arguments == "" and delta.id
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, calls, finishes


def test_auto_tool_calls_stream_name_first_then_the_arguments(client: openai.OpenAI) -> None:
    # A random model writes no <tool_call> on its own; a regex makes it write two (hermes parser).
    call = (
        r'<tool_call>\{"name": "get_weather", '
        r'"arguments": \{"city": "[a-z]{2,8}", "unit": "c"\}\}</tool_call>'
    )
    body = {"structured_outputs": {"regex": r"Checking\. " + call + call}}
    request: Any = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 200,
        "seed": 3,
        "extra_body": body,
    }
    whole = client.chat.completions.create(**request)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == "Checking. "
    expected = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert len(expected) == 2
    for _, arguments in expected:
        jsonschema.validate(json.loads(arguments), WEATHER)
    content, calls, finishes = _accumulate(client.chat.completions.create(**request, stream=True))
    assert content == "Checking. " and finishes == ["tool_calls"]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert sorted(calls) == [0, 1] and all(c["id"] for c in calls.values())


def test_an_invalid_schema_is_a_400(client: openai.OpenAI) -> None:
    bad: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}},
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad, max_tokens=5)
    assert "nope" in info.value.message
