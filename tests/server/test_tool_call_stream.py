"""tool_choice "auto" streamed through the server, one character a token (a scripted fake engine),
read with the official openai client: each call's first delta names it, its arguments follow in
pieces as they are generated, and the deltas add up to the non-streamed reply, both as a user
accumulates them by hand and as the client's own ChatCompletionStreamState does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from corral_engine.server import create_app
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.fake_engine import FakeEngine

MODEL = "fake-model"
END = "#"  # the fake engine's script ends the reply here (a stop string)
TOOLS: Any = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
ASK: Any = [{"role": "user", "content": "Weather and time in Paris?"}]
HERMES = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'
)
MISTRAL = (
    'Let me check both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
    '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}'
)
CASES = [
    ("hermes", HERMES, "Let me check both.\n"),
    ("llama3_json", LLAMA3, None),
    ("mistral", MISTRAL, "Let me check both."),
]


@contextlib.asynccontextmanager
async def _client(parser: str, script: str) -> AsyncIterator[openai.AsyncOpenAI]:
    app = create_app(FakeEngine(max_model_len=1024, script=script + END), tool_call_parser=parser)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            yield openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0
            )


def _request(script: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": len(script) + 1,
        "stop": [END],
        "temperature": 0,
        **extra,
    }


@pytest.mark.parametrize(("parser", "script", "content"), CASES)
async def test_streamed_tool_calls_add_up_to_the_whole_reply(
    parser: str, script: str, content: str | None
) -> None:
    async with _client(parser, script) as client:
        whole = await client.chat.completions.create(**_request(script))
        stream = await client.chat.completions.create(**_request(script, stream=True, n=2))
        chunks = [chunk async for chunk in stream]
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == content
    expected = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert expected == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("get_time", '{"tz": "Europe/Paris"}'),
    ]
    for index in (0, 1):
        streamed_content, calls, finishes, num_argument_deltas = "", {}, [], 0
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.index != index:
                    continue
                streamed_content += choice.delta.content or ""
                assert "<tool_call>" not in streamed_content and '"name"' not in streamed_content
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
                for call in choice.delta.tool_calls or []:
                    assert call.function is not None
                    if call.index not in calls:  # the first delta: id, type, name, no arguments yet
                        assert call.id and call.type == "function" and call.function.name
                        assert call.function.arguments == ""
                        assert sorted(calls) == list(range(call.index))
                        calls[call.index] = [call.function.name, ""]
                    else:
                        assert call.id is None and call.function.name is None
                        calls[call.index][1] += call.function.arguments or ""
                        num_argument_deltas += 1
        assert streamed_content == (content or "") and finishes == ["tool_calls"]
        assert [tuple(calls[i]) for i in sorted(calls)] == expected
        # One character a token: arguments arrive in many pieces, not once complete.
        assert num_argument_deltas > 20


@pytest.mark.parametrize(("parser", "script", "content"), CASES)
async def test_the_clients_own_accumulator_rebuilds_the_reply(
    parser: str, script: str, content: str | None
) -> None:
    async with _client(parser, script) as client:
        whole = await client.chat.completions.create(**_request(script))
        stream = await client.chat.completions.create(**_request(script, stream=True))
        state = ChatCompletionStreamState(input_tools=TOOLS)
        async for chunk in stream:
            state.handle_chunk(chunk)
    rebuilt = state.get_final_completion().choices[0]
    assert rebuilt.finish_reason == "tool_calls" and (rebuilt.message.content or None) == content
    assert [(c.id, c.type) for c in rebuilt.message.tool_calls or []] != []
    got = [(c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls or []]
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    assert got == want and len(got) == 2


async def test_a_reply_without_calls_streams_as_plain_content() -> None:
    script = "No tool is needed: <tool is not a tag."
    async with _client("hermes", script) as client:
        stream = await client.chat.completions.create(**_request(script, stream=True))
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == script
    assert all(not c.choices or c.choices[0].delta.tool_calls is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
