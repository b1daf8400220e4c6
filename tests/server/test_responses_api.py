"""POST /v1/responses: the request's translation onto the chat path, the response and its stream
as the official `openai` client reads them (a scripted fake engine, and a random-weight model for a
function-tool round trip), and the fields it refuses by name."""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any, get_args

import httpx
import jsonschema
import openai
import pytest
from corral_engine.errors import EngineDeadError
from corral_engine.server import create_app
from corral_engine.server.api_responses import ResponsesRequest
from corral_engine.server.api_tools import NO_TOOLS, Tool, plan_tools
from corral_engine.server.responses_output import ResponseShell, output_items
from corral_engine.server.responses_stream import ResponseEvents, ResponseStreamingResponse
from openai.types.shared import Reasoning as OpenAIReasoning
from openai.types.shared import ReasoningEffort

from tests.server.fake_engine import FakeEngine
from tests.server.real_engine import openai_client

FAKE = "fake-model"
HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
FLAT_TOOLS: Any = [
    {"type": "function", "name": n, "parameters": {"type": "object"}, "strict": False}
    for n in ("get_weather", "get_time")
]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": FAKE, **fields})


def test_input_items_become_the_chat_conversation() -> None:
    """A function_call joins the assistant turn before it, its output is a tool message, messages
    may omit `type`, and reasoning items from an earlier response are left out."""
    req = _request(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": "{}",
            },
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
    )
    assert req.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat = req.chat_request()
    assert [m.role for m in chat.messages] == ["system", "developer", "user", "assistant", "tool"]


def test_a_reasoning_item_sent_back_is_its_assistant_turns_reasoning_content() -> None:
    """As the output lists them (reasoning, message, call), and a call with only reasoning before
    it; reasoning before a user message has no turn to go with."""
    thought: Any = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None}
    req = _request(
        input=[
            {"role": "user", "content": "Weather?"},
            {**thought, "content": [{"type": "reasoning_text", "text": "Call it."}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {**thought, "content": [{"type": "reasoning_text", "text": "Again."}]},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_2", "output": "sunny"},
            {**thought, "content": [{"type": "reasoning_text", "text": "Dropped."}]},
            {"role": "user", "content": "Thanks"},
        ],
    )
    messages = req.messages()
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None),
        ("assistant", "Call it."),
        ("tool", None),
        ("assistant", "Again."),
        ("tool", None),
        ("user", None),
    ]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1"]
    chat = req.chat_request()
    assert chat.template_messages()[3]["reasoning_content"] == "Again."


def test_tools_choice_format_and_limits_map_onto_chat_fields() -> None:
    req = _request(
        input="hi",
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        max_output_tokens=7,
        temperature=0.5,
        seed=3,
        stop=["\n"],
        reasoning={"effort": "low"},
    )
    chat = req.chat_request()
    assert chat.tools is not None and [t.function.name for t in chat.tools] == ["get_weather", "get_time"]
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "get_time"  # type: ignore[union-attr]
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == WEATHER
    assert chat.requested_max_tokens == 7 and chat.temperature == 0.5
    assert chat.seed == 3 and chat.stop == ["\n"]  # chat's and vLLM's sampling fields pass through
    assert chat.template_kwargs()["reasoning_effort"] == "low"


def test_the_whole_reply_is_a_message_then_calls_and_the_last_item_carries_the_limit() -> None:
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": n}})
        for n in ("get_weather", "get_time")
    ]
    plan = plan_tools(tools, "auto", True, "hermes")
    items = output_items(plan, HERMES, "stop")
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me check.\n"
    assert json.loads(items[1]["arguments"]) == {"city": "Paris"} and items[1]["call_id"]
    # Only whitespace beside the calls: no message item.
    only_calls = output_items(plan, "\n" + HERMES.split("\n", 1)[1], "stop")
    assert [i["type"] for i in only_calls] == ["function_call", "function_call"]
    cut = output_items(NO_TOOLS, "hel", "length")
    assert cut[0]["status"] == "incomplete" and cut[0]["content"][0]["text"] == "hel"


def test_a_failure_after_the_start_ends_the_stream_with_an_error_event() -> None:
    events = ResponseEvents(ResponseShell(_request(input="hi"), "resp_1", FAKE, 0), NO_TOOLS)
    response = ResponseStreamingResponse.__new__(ResponseStreamingResponse)
    response._events = events
    [tail] = response.closing_events(EngineDeadError("the engine is dead"))
    kind, data = tail.decode().strip().split("\n")
    payload = json.loads(data.removeprefix("data: "))
    assert kind == "event: error" and payload["type"] == "error" and payload["sequence_number"] == 0
    assert payload["message"] == "the engine is dead"
    assert response.closing_events(None) == []  # no `data: [DONE]`: OpenAI's streams end without one


@contextlib.asynccontextmanager
async def _fake_client(
    script: str, can_listen: bool = True, **app_args: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    app = create_app(FakeEngine(max_model_len=1024, script=script, can_listen=can_listen), **app_args)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0
            )
            yield client, http


@pytest.mark.parametrize("can_listen", [True, False], ids=["listen", "stream"])
async def test_text_whole_and_streamed_as_the_client_reads_them(can_listen: bool) -> None:
    async with _fake_client("hello world! ", can_listen) as (client, http):
        r = await client.responses.create(
            model=FAKE, input="hi", instructions="Be nice.", max_output_tokens=5, metadata={"k": "v"}
        )
        assert r.object == "response" and r.id.startswith("resp_") and r.output_text == "hello"
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.metadata == {"k": "v"} and r.instructions == "Be nice."
        assert r.usage is not None and r.usage.output_tokens == 5
        assert r.usage.total_tokens == r.usage.input_tokens + 5
        raw = await http.post("/v1/responses", json={"model": FAKE, "input": "hi", "max_output_tokens": 3})
        assert list(raw.json())[-1] == "usage"  # last: the gateway reads usage from a body's end

        stream = await client.responses.create(model=FAKE, input="hi", max_output_tokens=5, stream=True)
        events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type == "response.incomplete"
    assert deltas == "hello" == last.response.output_text and last.response.usage is not None


async def test_streamed_tool_calls_add_up_to_the_whole_reply() -> None:
    """The same reply whole, as raw events, and through the client's own accumulator
    (`responses.stream()`), which checks every item's identity from added to done."""
    async with _fake_client(HERMES + "#", tool_call_parser="hermes") as (client, _):
        args: Any = {
            "model": FAKE,
            "input": "Weather?",
            "tools": FLAT_TOOLS,
            "max_output_tokens": len(HERMES) + 1,
            "extra_body": {"stop": ["#"]},  # the script's end: the reply completes
        }
        whole = await client.responses.create(**args)
        stream = await client.responses.create(**args, stream=True)
        events = [e async for e in stream]
        async with client.responses.stream(**args) as helper:
            accumulated = await helper.get_final_response()
    assert events[-1].type == "response.completed" and whole.status == "completed"
    streamed = events[-1].response.output
    for output in (whole.output, streamed, accumulated.output):
        assert [o.type for o in output] == ["message", "function_call", "function_call"]
        calls = [(o.name, json.loads(o.arguments)) for o in output if o.type == "function_call"]
        assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
        for o in output[1:]:  # OpenAI's id forms (chat's calls keep `chatcmpl-tool-` ids)
            assert o.id.startswith("fc_") and o.call_id.startswith("call_")  # type: ignore[union-attr]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == "".join(o.arguments for o in streamed if o.type == "function_call")
    assert whole.output_text == accumulated.output_text == "Let me check.\n"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"background": True}, "background", "background"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "text-only",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "stores no responses"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
            "input",
            "'input_file': parts here are text, refusals and input_image",
        ),
        ({"include": ["message.output_text.logprobs"]}, "include", "not available"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "'high'"),
        ({"reasoning": {"effort": 3}}, "reasoning.effort", "'high'"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary", "'concise'"),
        ({"reasoning": {"generate_summary": True}}, "reasoning.generate_summary", "'detailed'"),
        ({"reasoning": {"context": "never"}}, "reasoning.context", "'all_turns'"),
        ({"reasoning": "high"}, "reasoning", "an object"),
    ],
)
async def test_what_is_not_served_is_refused_by_name(body: dict[str, Any], param: str, words: str) -> None:
    async with _fake_client("x") as (_, http):
        r = await http.post("/v1/responses", json={"model": FAKE, "input": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_every_reasoning_value_openai_takes_is_taken() -> None:
    """As openai's own types list them; `effort` reaches the chat template as reasoning_effort."""
    for effort in get_args(get_args(ReasoningEffort)[0]):
        request = _request(input="hi", reasoning={"effort": effort})
        assert request.chat_request().reasoning_effort == effort
    for summary in get_args(get_args(OpenAIReasoning.model_fields["summary"].annotation)[0]):
        _request(input="hi", reasoning={"summary": summary, "generate_summary": summary, "mode": "pro"})


async def test_store_is_accepted_and_nothing_is_stored() -> None:
    async with _fake_client("x") as (client, http):
        r = await client.responses.create(
            model=FAKE, input="hi", store=True, max_output_tokens=1, tool_choice="auto"
        )
        assert r.model_dump()["store"] is False
        for method, path in [
            ("GET", r.id),
            ("DELETE", r.id),
            ("GET", f"{r.id}/input_items"),
            ("POST", f"{r.id}/cancel"),
        ]:
            got = await http.request(method, f"/v1/responses/{path}")
            assert got.status_code == 404 and "does not store responses" in got.json()["error"]["message"]


async def test_a_function_tool_round_trip_on_a_model(tiny_model_dir: pathlib.Path) -> None:
    """A named function call (the grammar holds it to the schema), its output sent back as input
    with the earlier output items, and the reply streamed through the client's own accumulator."""
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    async with openai_client(tiny_model_dir) as client:
        first = await client.responses.create(
            model="tiny-llama",
            input="Weather in Paris?",
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=64,
        )
        assert first.status == "completed"
        [call] = first.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        history: Any = [
            {"role": "user", "content": "Weather in Paris?"},
            *[o.model_dump(exclude_none=True) for o in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ]
        async with client.responses.stream(
            model="tiny-llama",
            input=history,
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=64,
        ) as stream:
            final = await stream.get_final_response()
        assert final.status == "completed" and final.usage is not None
        assert final.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
        [again] = final.output
        assert again.type == "function_call"
        jsonschema.validate(json.loads(again.arguments), WEATHER)
        text = await client.responses.create(
            model="tiny-llama", input=history, tools=tools, tool_choice="none", max_output_tokens=4
        )
        assert text.output[0].type == "message" and text.usage is not None and text.usage.output_tokens <= 4
        again_text = await client.responses.create(
            model="tiny-llama", input=history, tools=tools, tool_choice="none", max_output_tokens=4
        )
        assert again_text.usage is not None and again_text.usage.input_tokens_details.cached_tokens > 0
