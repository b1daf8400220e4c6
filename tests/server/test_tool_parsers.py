"""Tool-call parsers on recorded replies, whole and streamed in every chunking: a stream's content
and calls add up to the whole text's, each call is named before its arguments arrive, arguments
arrive while they are written (not in one piece once complete), and content is never taken back
nor holds a call's text."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from corral_engine.args import TOOL_CALL_PARSERS
from corral_engine.server.api_tools import Tool, ToolChoice, ToolPlan, plan_tools
from corral_engine.server.tool_calls import ReplyStream, reply_message
from corral_engine.server.tool_parsers import (
    TOOL_PARSERS,
    ArgumentsDelta,
    CallStart,
    Content,
    HermesParser,
    Llama3JsonParser,
    Parsed,
    ParsedCall,
    RequiredListParser,
    ToolEvent,
    ToolParser,
    collect,
    parse_whole,
)
from pydantic import TypeAdapter

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ParsedCall("get_time", '{"tz": "Europe/Paris"}')

# (parser, recorded reply, what it parses to)
RECORDED: list[tuple[str, str, Parsed]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        Parsed("", [WEATHER]),
    ),
    (
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        Parsed("Let me check both.\n", [WEATHER, TIME]),
    ),
    (
        "hermes",
        "No tools needed: 2 < 3 and <tool is not a tag.",
        Parsed("No tools needed: 2 < 3 and <tool is not a tag.", []),
    ),
    (  # unclosed at the end (the model stopped at EOS): still a call
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',
        Parsed("", [TIME]),
    ),
    ("hermes", "Hi <tool_call>{not json", Parsed("Hi <tool_call>{not json", [])),
    (  # braces, brackets, quotes and escapes inside strings; the name after the arguments
        "hermes",
        '<tool_call>{"arguments": {"q": "a}\\"]{[", "n": [1, {"x": null}], "ok": true}, "name": "search"}'
        "</tool_call>",
        Parsed("", [ParsedCall("search", '{"q": "a}\\"]{[", "n": [1, {"x": null}], "ok": true}')]),
    ),
    (  # arguments written as a JSON string are decoded; a call without arguments gets {}
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Paris\\"}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>',
        Parsed("", [TIME, ParsedCall("now", "{}")]),
    ),
    (  # a block that is not a call is dropped, and so is text between blocks
        "hermes",
        'Sure. <tool_call>{"nam": "x"}</tool_call> and <tool_call>{"name": "now", "arguments": {}}'
        "</tool_call> done",
        Parsed("Sure. ", [ParsedCall("now", "{}")]),
    ),
    (  # the block closes inside the arguments: they end there, whatever the chunking
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',
        Parsed("", [ParsedCall("f", '{"a": 1')]),
    ),
    (  # cut off by max_tokens inside the arguments: a call, cut off
        "hermes",
        'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
        Parsed("Checking. ", [ParsedCall("get_weather", '{"city": "Pa')]),
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        Parsed("", [WEATHER]),
    ),
    (  # cut off right after the names: calls with no arguments yet (nothing made up)
        "llama3_json",
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}; {"name": "get_weather", "param',
        Parsed("", [TIME, ParsedCall("get_weather", "")]),
    ),
    ("hermes", 'Hm. <tool_call>{"name": "get_time"', Parsed("Hm. ", [ParsedCall("get_time", "")])),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        Parsed("", [WEATHER, TIME]),
    ),
    ("llama3_json", "The weather in Paris is sunny.", Parsed("The weather in Paris is sunny.", [])),
    ("llama3_json", "{ this is not json", Parsed("{ this is not json", [])),
    ("llama3_json", '  {"answer": 42} is the JSON', Parsed('  {"answer": 42} is the JSON', [])),
    (
        "llama3_json",
        '\n{"name": "get_time", "parameters": {"tz": "Europe/Paris"}} and then some text',
        Parsed("", [TIME]),
    ),
    ("llama3_json", "<|python_tag|>print(1)", Parsed("<|python_tag|>print(1)", [])),
    (  # Mistral v0.3: a JSON array after the marker
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        Parsed("", [WEATHER, TIME]),
    ),
    (  # v11+: name[ARGS]arguments, each call after its own marker; content before the first
        "mistral",
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "Europe/Paris"}',
        Parsed("Checking.", [WEATHER, TIME]),
    ),
    (  # the markers are special tokens, which returned text leaves out
        "mistral",
        'get_weather{"city": "Paris", "unit": "celsius"}get_time{"tz": "Europe/Paris"}',
        Parsed("", [WEATHER, TIME]),
    ),
    (
        "mistral",
        '[{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        Parsed("", [TIME]),
    ),
    ("mistral", "[1, 2] and {x} are [TOOL", Parsed("[1, 2] and {x} are [TOOL", [])),
    ("mistral", "Sunny, 21 degrees.", Parsed("Sunny, 21 degrees.", [])),
    (  # cut off right after the name
        "mistral",
        "[TOOL_CALLS]get_time[ARGS]",
        Parsed("", [ParsedCall("get_time", "")]),
    ),
    (  # cut off inside the arguments
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        Parsed("", [ParsedCall("get_weather", '{"city": "Pa')]),
    ),
    (  # pythonic: a Python list of calls, keyword arguments as literals
        "pythonic",
        '[get_weather(city="Paris", unit=\'celsius\'), get_time(tz="Europe/Paris")]',
        Parsed("", [WEATHER, TIME]),
    ),
    ("pythonic", "Sunny, 21 degrees.", Parsed("Sunny, 21 degrees.", [])),
    ("pythonic", "[1, 2] and (3) are numbers", Parsed("[1, 2] and (3) are numbers", [])),
    ("pythonic", "[Note] get_time(tz=1)", Parsed("[Note] get_time(tz=1)", [])),
    (  # brackets, quotes and escapes inside strings; nested literals; a trailing comma
        "pythonic",
        ' [search(q="a)]\\"(", n=[1, {"x": None}, (2, -3.5)], ok=True, s="""x\ny""",),\n]',
        Parsed(
            "",
            [
                ParsedCall(
                    "search", '{"q": "a)]\\"(", "n": [1, {"x": null}, [2, -3.5]], "ok": true, "s": "x\\ny"}'
                )
            ],
        ),
    ),
    ("pythonic", "[get_time(tz=tz)]", Parsed("[get_time(tz=tz)]", [])),  # not a literal: never evaluated
    ("pythonic", '[get_time("UTC")]', Parsed('[get_time("UTC")]', [])),  # positional arguments
    ("pythonic", "[get_time(tz={1, 2})]", Parsed("[get_time(tz={1, 2})]", [])),  # a set has no JSON form
    (  # a later call that does not parse ends the list; so does its `]`
        "pythonic",
        '[get_time(tz="Europe/Paris"), os.system(cmd="ls")] [get_time()]',
        Parsed("", [TIME]),
    ),
    (  # cut off after the first call / inside it
        "pythonic",
        '[get_time(tz="Europe/Paris"), get_weather(city="Pa',
        Parsed("", [TIME]),
    ),
    ("pythonic", '[get_weather(city="Pa', Parsed('[get_weather(city="Pa', [])),
    ("pythonic", "[get_time()]", Parsed("", [ParsedCall("get_time", "{}")])),
    (  # qwen3_coder: content, then XML blocks (values are strings without the request's schemas)
        "qwen3_coder",
        "Let me check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>",
        Parsed("Let me check both.\n", [WEATHER, TIME]),
    ),
    (
        "qwen3_coder",
        "No tools: 2 < 3 and <function is not a tag.",
        Parsed("No tools: 2 < 3 and <function is not a tag.", []),
    ),
    (  # without the block tag; a value's inner newlines and `<` are its own
        "qwen3_coder",
        "<function=run>\n<parameter=code>\nif a < b:\n    print('<x>')\n\n</parameter>\n</function>",
        Parsed("", [ParsedCall("run", '{"code": "if a < b:\\n    print(\'<x>\')\\n"}')]),
    ),
    (  # </parameter> left out: the next parameter or </function> ends the value
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=unit>\ncelsius\n"
        "</function>\n</tool_call>",
        Parsed("", [WEATHER]),
    ),
    (  # cut off inside a value: the call is closed, its last value as far as written
        "qwen3_coder",
        "Checking. <tool_call>\n<function=get_weather>\n<parameter=city>\nPa",
        Parsed("Checking. ", [ParsedCall("get_weather", '{"city": "Pa"}')]),
    ),
    (
        "qwen3_coder",
        "Hm. <tool_call>\n<function=get_wea",
        Parsed("Hm. <tool_call>\n<function=get_wea", []),
    ),
    (  # a template left unrendered is no call
        "qwen3_coder",
        "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>",
        Parsed("<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>", []),
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=now>\n</function>\n</tool_call>",
        Parsed("", [ParsedCall("now", "{}")]),
    ),
]


def _chunkings(text: str, seed: int) -> Iterator[list[str]]:
    """Every split in two, every character alone, and random splits (with empty pieces too)."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(1, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _stream_events(make: Callable[[], ToolParser], pieces: list[str]) -> list[list[ToolEvent]]:
    parser = make()
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def _content(events: list[ToolEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Content))


def _check_event_order(events: list[ToolEvent], expected: Parsed) -> None:
    """Names before arguments, indexes 0, 1, ... in order, content only outside calls' text."""
    started: list[int] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(started)
            started.append(event.index)
        elif isinstance(event, ArgumentsDelta):
            assert event.index in started and event.text
        else:
            assert isinstance(event, Content) and event.text
    assert len(started) == len(expected.calls)


@pytest.mark.parametrize(("name", "text", "expected"), RECORDED)
def test_streamed_in_any_chunking_equals_the_whole_text(name: str, text: str, expected: Parsed) -> None:
    make = TOOL_PARSERS[name]
    assert parse_whole(make, text) == expected
    for pieces in _chunkings(text, seed=len(text)):
        per_feed = _stream_events(make, pieces)
        events = [e for feed in per_feed for e in feed]
        assert collect(events) == expected, pieces
        _check_event_order(events, expected)


@pytest.mark.parametrize(("name", "text", "expected"), RECORDED)
def test_content_so_far_is_always_a_prefix_of_the_final_content(
    name: str, text: str, expected: Parsed
) -> None:
    parser = TOOL_PARSERS[name]()
    content = ""
    for ch in text:
        content += _content(parser.feed(ch))
        assert expected.content.startswith(content)
    assert content + _content(parser.finish()) == expected.content


def test_arguments_stream_while_they_are_written() -> None:
    parser = HermesParser()
    events = parser.feed('OK <tool_call>\n{"name": "get_weather"')
    assert events == [Content("OK "), CallStart(0, "get_weather")]
    assert parser.feed(', "arguments": {"ci') == [ArgumentsDelta(0, '{"ci')]
    assert parser.feed('ty": "Paris"') == [ArgumentsDelta(0, 'ty": "Paris"')]
    assert parser.feed("}}\n</tool") == [ArgumentsDelta(0, "}")]
    assert parser.feed("_call>") == [] and parser.finish() == []
    llama = Llama3JsonParser()
    assert llama.feed('<|python_tag|>{"name": "f", "parameters": {"x": ') == [
        CallStart(0, "f"),
        ArgumentsDelta(0, '{"x": '),
    ]
    assert llama.feed("1") == [ArgumentsDelta(0, "1")]  # a number may go on; it is sent as written
    assert llama.feed("2}};") == [ArgumentsDelta(0, "2}")]
    required = RequiredListParser()
    assert required.feed('[{"name":"f","parameters":{"a"') == [CallStart(0, "f"), ArgumentsDelta(0, '{"a"')]


def test_content_is_held_back_only_while_it_could_start_a_call() -> None:
    parser = HermesParser()
    assert parser.feed("Checking <tool") == [Content("Checking ")]
    assert parser.feed("box>") == [Content("<toolbox>")]
    assert parser.feed(" <tool_c") == [Content(" ")]
    assert parser.finish() == [Content("<tool_c")]
    llama = Llama3JsonParser()
    assert llama.feed("  ") == []
    assert llama.feed("<|python") == []
    assert llama.feed("_tag|>") == []
    assert llama.feed(' {"name": "f", "parameters": {}}') == [CallStart(0, "f"), ArgumentsDelta(0, "{}")]


def _reply_stream(plan: ToolPlan, pieces: list[str]) -> list[dict[str, Any]]:
    reply = ReplyStream(plan)
    return [d for i, piece in enumerate(pieces) for d in reply.feed(piece, is_final=i == len(pieces) - 1)]


def _accumulate(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """What an openai client user builds from the deltas: content, and calls by index."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.get("id", "")
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("name", "text", "expected"), RECORDED)
def test_chunk_deltas_add_up_to_the_whole_message(name: str, text: str, expected: Parsed) -> None:
    plan = ToolPlan(None, TOOL_PARSERS[name])
    message = reply_message(plan, text)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert whole == [(c.name, c.arguments) for c in expected.calls]
    assert message["content"] == (expected.content or None if expected.calls else expected.content)
    for pieces in [list(text), [text[: len(text) // 2], text[len(text) // 2 :], ""], [text]]:
        deltas = _reply_stream(plan, pieces)
        content, calls = _accumulate(deltas)
        assert content == expected.content
        assert [(c["name"], c["arguments"]) for c in calls] == whole
        assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
        for delta in deltas:  # a call's first delta names it, with arguments ""; later ones add to them
            for call in delta.get("tool_calls", []):
                assert set(delta) == {"tool_calls"} and len(delta["tool_calls"]) == 1
                if "id" in call:
                    assert call["type"] == "function" and call["function"]["arguments"] == ""
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}


def test_required_list_and_named_replies() -> None:
    text = (
        '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}},'
        '{"name":"get_time","parameters":{"tz":"Europe/Paris"}}]'
    )
    expected = Parsed(
        "", [ParsedCall(c.name, c.arguments.replace(": ", ":").replace(", ", ",")) for c in (WEATHER, TIME)]
    )
    assert parse_whole(RequiredListParser, text) == expected
    for pieces in _chunkings(text, seed=1):
        assert collect([e for feed in _stream_events(RequiredListParser, pieces) for e in feed]) == expected
    named = ToolPlan(None, None, named="get_time")
    message = reply_message(named, '{"tz":"UTC"}')
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": '{"tz":"UTC"}',
    }
    deltas = _reply_stream(named, ['{"tz"', ':"UTC"}'])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert _accumulate(deltas) == (
        "",
        [{"id": deltas[0]["tool_calls"][0]["id"], "name": "get_time", "arguments": '{"tz":"UTC"}'}],
    )


@pytest.mark.parametrize(("name", "text", "expected"), [r for r in RECORDED if len(r[2].calls) > 1])
def test_parallel_tool_calls_false_keeps_the_first_call(name: str, text: str, expected: Parsed) -> None:
    # OpenAI's promise for parallel_tool_calls false: one call at most, also under "auto".
    tools = [Tool.model_validate({"type": "function", "function": {"name": c.name}}) for c in expected.calls]
    plan = plan_tools(tools, "auto", False, name)
    message = reply_message(plan, text)
    first = expected.calls[0]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        (first.name, first.arguments)
    ]
    for pieces in [list(text), [text]]:
        content, calls = _accumulate(_reply_stream(plan, pieces))
        assert content == expected.content
        assert [(c["name"], c["arguments"]) for c in calls] == [(first.name, first.arguments)]


def test_llama3_json_objects_naming_no_offered_tool_are_content() -> None:
    # With tools offered, a JSON answer that happens to have a "name" is an answer, not a call.
    tools = [Tool.model_validate({"type": "function", "function": {"name": c.name}}) for c in (WEATHER, TIME)]
    plan = plan_tools(tools, "auto", True, "llama3_json")
    answer = '{"name": "Ada", "age": 36}'
    calls_then_answer = f'{{"name": "get_time", "parameters": {TIME.arguments}}}; {answer}'
    for text, content, calls in [(answer, answer, []), (calls_then_answer, "", [TIME])]:
        message = reply_message(plan, text)
        whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert whole == [(c.name, c.arguments) for c in calls]
        assert (message["content"] or "") == content
        for pieces in _chunkings(text, seed=2):
            streamed_content, streamed_calls = _accumulate(_reply_stream(plan, pieces))
            assert streamed_content == content
            assert [(c["name"], c["arguments"]) for c in streamed_calls] == whole


def test_without_a_parser_the_reply_is_content() -> None:
    plain = ToolPlan(None, None)
    assert _reply_stream(plain, ["a", "", "b"]) == [{"content": "a"}, {"content": "b"}]
    assert reply_message(plain, '<tool_call>{"name": "f"}') == {
        "role": "assistant",
        "content": '<tool_call>{"name": "f"}',
    }


def test_the_option_lists_every_parser() -> None:
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)


def test_mistral_calls_without_markers_must_name_an_offered_tool() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {"name": c.name}}) for c in (WEATHER, TIME)]
    plan = plan_tools(tools, "auto", True, "mistral")
    cases = [
        ('[{"name": "Ada", "age": 36}]', '[{"name": "Ada", "age": 36}]', []),
        ("print{1}", "print{1}", []),
        (f"get_time{TIME.arguments}", "", [TIME]),
        ('Sure.[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}', "Sure.", [ParsedCall("rm_rf", '{"path": "/"}')]),
    ]
    for text, content, calls in cases:
        message = reply_message(plan, text)
        whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert whole == [(c.name, c.arguments) for c in calls]
        assert (message["content"] or "") == content
        for pieces in _chunkings(text, seed=3):
            streamed_content, streamed_calls = _accumulate(_reply_stream(plan, pieces))
            assert streamed_content == content
            assert [(c["name"], c["arguments"]) for c in streamed_calls] == whole


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    # Mistral's chat templates refuse a call sent back with any other id.
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_time"}})]
    text = f"[TOOL_CALLS]get_time[ARGS]{TIME.arguments}"
    ids = []
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        plan = plan_tools(tools, TypeAdapter(ToolChoice).validate_python(choice), True, "mistral")
        reply = '[{"name": "get_time", "parameters": {}}]' if choice == "required" else text
        ids.append(reply_message(plan, reply)["tool_calls"][0]["id"])
        ids.extend(c["id"] for c in _accumulate(_reply_stream(plan, [reply[:5], reply[5:]]))[1])
    assert len(ids) == 6 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids), ids
    hermes = plan_tools(tools, "auto", True, "hermes")
    assert hermes.new_call_id().startswith("chatcmpl-tool-")
