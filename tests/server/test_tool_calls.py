"""Tool calling through the server with the official openai client on a random-weight model:
named and required choices are enforced by the grammar, "auto" parses the reply with
--tool-call-parser, and conversations carrying tool calls and results reach the chat template."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.real_engine import openai_client

MODEL = "tiny-llama"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "set_alarm", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "set_alarm": TIME_PARAMS}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def client(tiny_model_dir: pathlib.Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(tiny_model_dir, tool_call_parser="hermes") as c:
        yield c


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def test_named_tool_choice_returns_a_valid_call(client: openai.AsyncOpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64, seed=seed, n=2
        )
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls"
            calls = ch.message.tool_calls or []
            assert len(calls) == 1 and calls[0].function.name == "get_weather"
            assert calls[0].id and calls[0].type == "function"
            _check_call("get_weather", calls[0].function.arguments)
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64, seed=9, stream=True
    )
    name, arguments, finishes = None, "", []
    async for chunk in stream:
        for ch in chunk.choices:
            for call in ch.delta.tool_calls or []:
                assert call.index == 0
                name = name or (call.function.name if call.function else None)
                arguments += (call.function.arguments or "") if call.function else ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert name == "get_weather" and finishes == ["tool_calls"]
    _check_call("get_weather", arguments)


async def test_a_function_without_parameters_is_called_without_arguments(client: openai.AsyncOpenAI) -> None:
    # OpenAI: omitting `parameters` defines a function with an empty parameter list.
    now: Any = [{"type": "function", "function": {"name": "now"}}]
    named: Any = {"type": "function", "function": {"name": "now"}}
    for choice, seed in [(named, 0), (named, 1), ("required", 2)]:
        r = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=now, tool_choice=choice, max_tokens=32, seed=seed
        )
        calls = r.choices[0].message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in calls][:1] == [("now", "{}")]


async def test_required_returns_at_least_one_valid_call(client: openai.AsyncOpenAI) -> None:
    for seed in range(3):
        r = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=96,
            seed=seed,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        assert len(ch.message.tool_calls) == 1
        for call in ch.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=90, seed=4, stream=True
    )
    calls: dict[int, tuple[str, str]] = {}
    finishes = []
    async for chunk in stream:
        for ch in chunk.choices:
            finishes += [ch.finish_reason] if ch.finish_reason else []
            for call in ch.delta.tool_calls or []:
                assert call.function is not None
                if call.index not in calls:  # the first delta names the call, arguments follow
                    assert call.function.name and call.function.arguments == ""
                    calls[call.index] = (call.function.name, "")
                else:
                    name, arguments = calls[call.index]
                    calls[call.index] = (name, arguments + (call.function.arguments or ""))
    assert calls and sorted(calls) == list(range(len(calls)))
    if finishes == ["length"]:  # max_tokens cut the array: its last call is cut off too
        calls.pop(len(calls) - 1)
    else:
        assert finishes == ["tool_calls"]
    assert calls
    for name, arguments in calls.values():
        _check_call(name, arguments)


async def test_required_takes_parameters_with_references(client: openai.AsyncOpenAI) -> None:
    # pydantic models (openai.pydantic_function_tool, LangChain) put nested models in `$defs`;
    # two tools may each have their own `Place`, and a schema may refer to itself (`#`).
    def params(place: dict[str, Any]) -> dict[str, Any]:
        return {
            "$defs": {"Place": place},
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}},
            "required": ["place"],
            "additionalProperties": False,
        }

    schemas = {
        "weather": params({"type": "string", "maxLength": 6}),
        "nest": params({"type": "array", "maxItems": 1, "items": {"$ref": "#"}}),
    }
    tools: Any = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    for seed in range(3):
        r = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=72,
            seed=seed,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


async def test_auto_parses_hermes_calls_out_of_the_reply(client: openai.AsyncOpenAI) -> None:
    # A random model never writes <tool_call> on its own; a regex makes it write one.
    regex = (
        r'I will check\.<tool_call>\{"name": "get_weather", '
        r'"arguments": \{"city": "[a-z]{1,8}", "unit": "celsius"\}\}</tool_call>'
    )
    body = {"structured_outputs": {"regex": regex}}
    r = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=90, seed=1, extra_body=body
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "I will check."
    assert ch.message.tool_calls and ch.message.tool_calls[0].function.name == "get_weather"
    _check_call("get_weather", ch.message.tool_calls[0].function.arguments)
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=90, seed=1, extra_body=body, stream=True
    )
    content, names, arguments = "", [], ""
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                assert call.index == 0 and call.function is not None
                if call.function.name:  # the first delta: the name, before any arguments
                    assert not arguments and call.function.arguments == ""
                    names.append(call.function.name)
                arguments += call.function.arguments or ""
    assert content == "I will check." and names == ["get_weather"]
    assert arguments == ch.message.tool_calls[0].function.arguments
    plain = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, seed=1)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"
    none = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=90, seed=1, extra_body=body
    )
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in (
        none.choices[0].message.content or ""
    )


async def test_a_conversation_with_tool_calls_and_results_is_accepted(client: openai.AsyncOpenAI) -> None:
    messages: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, seed=0
    )
    assert r.choices[0].message.role == "assistant"
    # The template saw the call and the result: the prompt is longer than without them.
    short = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, seed=0)
    assert r.usage and short.usage and r.usage.prompt_tokens > short.usage.prompt_tokens + 20


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2] repeats the function name `get_weather`"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}},
            "Responses API's form",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {
                        "mode": "auto",
                        "tools": [{"type": "function", "function": {"name": "x"}}],
                    },
                },
            },
            "allowed_tools names `x`, which is not in tools",
        ),
    ],
)
async def test_impossible_tool_requests_are_400s(
    client: openai.AsyncOpenAI, body: dict[str, Any], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert needle in str(info.value.message)


async def test_allowed_tools_limits_the_calls_to_the_listed_functions(client: openai.AsyncOpenAI) -> None:
    ref: Any = {"type": "function", "function": {"name": "set_alarm"}}
    for mode in ("required", "auto"):
        choice: Any = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [ref]}}
        r = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=96, seed=0
        )
        if mode == "required":
            calls = r.choices[0].message.tool_calls or []
            assert calls and {c.function.name for c in calls} == {"set_alarm"}
            for call in calls:
                _check_call(call.function.name, call.function.arguments)
        # every tool is still rendered: the prompt is the one "auto" over all of them gets
        plain = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
        assert r.usage and plain.usage and r.usage.prompt_tokens == plain.usage.prompt_tokens


async def test_auto_needs_a_parser(tiny_model_dir: pathlib.Path) -> None:
    async with openai_client(tiny_model_dir) as plain:
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
            await plain.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
        r = await plain.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96, seed=0
        )
        assert r.choices[0].message.tool_calls
