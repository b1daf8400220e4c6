"""tool_choice "auto" with `--tool-call-parser pythonic` and `qwen3_coder` through the server on the
tiny random-weight model, read with the official openai client: a regex makes the model write the
format (it never would on its own), and the streamed deltas add up to the whole reply's calls."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import openai
import pytest

from tests.server.real_engine import openai_client

MODEL = "tiny-llama"
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
ASK: Any = [{"role": "user", "content": "Weather in Paris, and the time?"}]
# (parser, a regex for what the model writes, the content before the calls)
CASES = [
    ("pythonic", r'\[get_weather\(city="[a-z]{1,8}", days=[1-9]\), get_time\(\)\]', None),
    (
        "qwen3_coder",
        r"I will check\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n[a-z]{1,8}\n</parameter>\n"
        r"<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>\n"
        r"<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I will check.\n",
    ),
]


async def _stream(client: openai.AsyncOpenAI, body: dict[str, Any]) -> tuple[str, list[list[str]], list[str]]:
    """The streamed content, each call's [name, arguments] as its deltas add up, and finish reasons."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, seed=1, extra_body=body, stream=True
    )
    content, calls, finishes = "", {}, []
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finishes += [choice.finish_reason] if choice.finish_reason else []
            for call in choice.delta.tool_calls or []:
                assert call.function is not None
                if call.index not in calls:  # its first delta names it, before any arguments
                    assert call.id and call.function.name and call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.function.name is None
                    calls[call.index][1] += call.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finishes


@pytest.mark.parametrize(("parser", "regex", "content"), CASES)
async def test_auto_parses_the_format_whole_and_streamed(
    tiny_model_dir: pathlib.Path, parser: str, regex: str, content: str | None
) -> None:
    body = {"structured_outputs": {"regex": regex}}
    async with openai_client(tiny_model_dir, tool_call_parser=parser) as client:
        whole = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, seed=1, extra_body=body
        )
        streamed = await _stream(client, body)
        plain = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, seed=1
        )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    weather = calls[0][1]
    assert set(weather) == {"city", "days"} and isinstance(weather["days"], int)  # typed, not "3"
    assert weather["city"].isalpha() and calls[1][1] == {}
    expected = [[c.function.name, c.function.arguments] for c in choice.message.tool_calls or []]
    assert streamed == (content or "", expected, ["tool_calls"])
    # A reply in no call format is content (the random model writes no list nor tag of its own).
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
