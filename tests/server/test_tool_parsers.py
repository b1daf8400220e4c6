"""Tool-call parsers on recorded replies, whole and streamed in arbitrary chunkings: a stream's
content and calls always equal the whole text's, and content is never taken back."""

from __future__ import annotations

import json
import random

import pytest
from corral_engine.server.api_tools import ToolPlan
from corral_engine.server.tool_calls import ReplyStream, reply_message
from corral_engine.server.tool_parsers import (
    TOOL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    RequiredListParser,
    ToolParser,
)

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"tz": "Europe/Paris"})

# (parser, recorded reply, expected content, expected calls)
RECORDED: list[tuple[str, str, str, list[tuple[str, dict[str, object]]]]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "",
        [WEATHER],
    ),
    (
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me check both.\n",
        [WEATHER, TIME],
    ),
    (
        "hermes",
        "No tools needed: 2 < 3 and <tool is not a tag.",
        "No tools needed: 2 < 3 and <tool is not a tag.",
        [],
    ),
    (  # unclosed at the end (the model stopped at EOS): still a call
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',
        "",
        [TIME],
    ),
    ("hermes", "Hi <tool_call>{not json", "Hi <tool_call>{not json", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [WEATHER],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        "",
        [WEATHER, TIME],
    ),
    ("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3_json", "{ this is not json", "{ this is not json", []),
]


def _calls(parsed_calls: list) -> list[tuple[str, dict[str, object]]]:  # type: ignore[type-arg]
    return [(c.name, json.loads(c.arguments)) for c in parsed_calls]


def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:  # type: ignore[type-arg]
    reply = ReplyStream(plan)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        text, deltas = reply.feed(piece, is_final=i == len(pieces) - 1)
        content += text
        calls += deltas
    return content, calls


def _chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    ways = [[text], list(text), [text[:1], text[1:]]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return [[*w, ""] for w in ways] + ways  # with and without an empty final delta


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_whole_and_streamed_replies_agree(
    name: str, text: str, content: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    parser: ToolParser = TOOL_PARSERS[name]()
    parsed = parser.parse(text, is_final=True)
    assert parsed.content == content
    assert _calls(parsed.calls) == calls
    plan = ToolPlan(None, parser)
    message = reply_message(plan, text)
    assert message.get("content") == (content or None if calls else content)
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
    ] == calls
    for pieces in _chunkings(text, seed=len(text)):
        streamed_content, deltas = _stream(plan, pieces)
        assert streamed_content == content, pieces
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert all(d["id"].startswith("chatcmpl-tool-") and d["type"] == "function" for d in deltas)
        assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == calls


def test_content_is_held_back_only_while_it_could_start_a_call() -> None:
    reply = ReplyStream(ToolPlan(None, HermesParser()))
    assert reply.feed("Checking <tool", is_final=False) == ("Checking ", [])
    assert reply.feed("box>", is_final=False) == ("<toolbox>", [])
    llama = ReplyStream(ToolPlan(None, Llama3JsonParser()))
    assert llama.feed("  ", is_final=False) == ("", [])
    assert llama.feed("<|python", is_final=False) == ("", [])
    assert llama.feed("_tag|>", is_final=False) == ("", [])
    text, calls = llama.feed('{"name": "f", "parameters": {}}', is_final=False)
    assert text == "" and calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_required_list_and_named_replies() -> None:
    text = (
        '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}},'
        '{"name":"get_time","parameters":{"tz":"Europe/Paris"}}]'
    )
    plan = ToolPlan(None, RequiredListParser())
    assert _calls(RequiredListParser().parse(text, True).calls) == [WEATHER, TIME]
    for pieces in _chunkings(text, seed=1):
        assert [d["function"]["name"] for d in _stream(plan, pieces)[1]] == ["get_weather", "get_time"]
    named = ToolPlan(None, None, named="get_time")
    message = reply_message(named, '{"tz":"UTC"}')
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": '{"tz":"UTC"}',
    }
    content, deltas = _stream(named, ['{"tz"', ':"UTC"}'])
    assert content == "" and deltas[0]["function"] == {"name": "get_time", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"tz":"UTC"}'
    assert all(d["index"] == 0 for d in deltas) and "id" not in deltas[1]


def test_the_option_lists_every_parser() -> None:
    from corral_engine.args import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
