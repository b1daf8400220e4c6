"""--reasoning-parser through the server, read with the official openai client: a scripted fake
engine (one byte a token) for the reply's shapes, streamed and not, with tool calls, thinking off,
a block never closed, include_reasoning, reasoning tokens and /v1/responses' reasoning items; a
real engine on the tiny model for a JSON schema that holds after the reasoning block."""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from corral_engine.demo_model import write_demo_model
from corral_engine.server import create_app
from corral_engine.server.reasoning import reasoning_fields
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import Fitted, Profile
from tokenizers import AddedToken, Tokenizer

from tests.server.fake_engine import FakeEngine, FakeTokenizer
from tests.server.real_engine import openai_client

MODEL = "fake-model"
PROFILE = Profile("test", Fitted((1e-4, 0.0, 0.0, 0.0, 0.0)), num_kv_blocks=256, max_model_len=1024)
END = "#"  # the script's stop string
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
THOUGHT = "The user wants the weather. I should call <tool_call> get_weather."
SCRIPT = (
    f"<think>\n{THOUGHT}\n</think>\n\nLet me check.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


class ThinkingTokenizer(FakeTokenizer):
    """A Qwen3-like template: `enable_thinking: false` closes an empty block in the prompt, and an
    assistant turn's reasoning_content is written back in a block."""

    def apply_chat_template(  # type: ignore[override]
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        text = ""
        for m in messages:
            thought = m.get("reasoning_content")
            text += f"<{m['role']}>" + (f"<think>{thought}</think>" if thought else "") + f"{m['content']}\n"
        if continue_final_message:  # the prompt ends where the final message's text does
            text = text.removesuffix("\n")
        if add_generation_prompt:
            text += "<assistant>" + ("" if enable_thinking else "<think>\n\n</think>\n\n")
        return text


@contextlib.asynccontextmanager
async def _client(
    script: str, reasoning_parser: str | None = "qwen3", **app_args: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, FakeEngine]]:
    engine = FakeEngine(max_model_len=1024, script=script + END)
    engine.tokenizer = ThinkingTokenizer()
    app = create_app(engine, reasoning_parser=reasoning_parser, **app_args)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0
            )
            yield client, engine


def _request(script: str, **extra: Any) -> dict[str, Any]:
    request = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": len(script) + 1,
        "stop": [END],
        "temperature": 0,
    }
    return request | extra


async def _streamed(client: openai.AsyncOpenAI, **request: Any) -> dict[int, dict[str, Any]]:
    """Each choice's stream, accumulated: reasoning, content (None: no content delta), calls,
    finish reasons, and whether content came before reasoning ended."""
    choices: dict[int, dict[str, Any]] = {}
    stream = await client.chat.completions.create(**request, stream=True)
    async for chunk in stream:
        for c in chunk.choices:
            got = choices.setdefault(
                c.index, {"reasoning": "", "content": None, "calls": [], "finishes": [], "mixed": False}
            )
            thought = getattr(c.delta, "reasoning_content", None)
            if thought:
                got["reasoning"] += thought
                got["mixed"] |= bool(got["content"])
            if c.delta.content is not None:
                got["content"] = (got["content"] or "") + c.delta.content
            got["calls"] += [
                t.function.name for t in c.delta.tool_calls or [] if t.function and t.function.name
            ]
            if c.finish_reason:
                got["finishes"].append(c.finish_reason)
    return choices


async def test_reasoning_is_apart_from_content_and_tool_calls() -> None:
    async with _client(SCRIPT, tool_call_parser="hermes") as (client, _):
        whole = await client.chat.completions.create(**_request(SCRIPT, tools=TOOLS))
        streamed = await _streamed(client, **_request(SCRIPT, tools=TOOLS, n=2))
    choice = whole.choices[0]
    assert choice.message.model_extra == reasoning_fields(THOUGHT)
    assert choice.message.content == "Let me check."
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"
    for index in (0, 1):
        got = streamed[index]
        assert got["reasoning"] == THOUGHT and not got["mixed"]  # content only after the end tag
        assert got["content"] == "Let me check." and got["calls"] == ["get_weather"]
        assert got["finishes"] == ["tool_calls"]


async def test_usage_counts_every_token_of_the_reply_and_those_of_the_block() -> None:
    """`completion_tokens_details.reasoning_tokens`: the block's tokens, its tags included (one
    byte a token here), streamed or not; 0 without a parser or with thinking off."""
    block = len(f"<think>\n{THOUGHT}\n</think>")
    stream: Any = {"stream_options": {"include_usage": True}}
    off: Any = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    async with _client(SCRIPT) as (client, _):
        parsed = await client.chat.completions.create(**_request(SCRIPT))
        chunks = await client.chat.completions.create(**_request(SCRIPT), stream=True, **stream)
        [streamed] = [c.usage async for c in chunks if c.usage is not None]
        thinking_off = await client.chat.completions.create(**_request(SCRIPT), **off)
    async with _client(SCRIPT, reasoning_parser=None) as (client, _):
        plain = await client.chat.completions.create(**_request(SCRIPT))
    assert plain.choices[0].message.content == SCRIPT
    assert parsed.usage is not None and plain.usage is not None and thinking_off.usage is not None
    assert parsed.usage.completion_tokens == plain.usage.completion_tokens == len(SCRIPT.encode()) + 1
    for usage, reasoning in (
        (parsed.usage, block),
        (streamed, block),
        (plain.usage, 0),
        (thinking_off.usage, 0),
    ):
        assert usage.completion_tokens_details is not None
        assert usage.completion_tokens_details.reasoning_tokens == reasoning
    assert streamed == parsed.usage


async def test_continuous_usage_counts_the_reasoning_tokens_so_far_on_every_chunk() -> None:
    """vLLM's continuous_usage_stats: each chunk's usage has the reasoning tokens of those sent so
    far, as the final usage has all of them (0 without a parser), for each of n choices."""
    block = len(f"<think>\n{THOUGHT}\n</think>")
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    for parser, expected in (("qwen3", block), (None, 0)):
        async with _client(SCRIPT, reasoning_parser=parser) as (client, _):
            stream = await client.chat.completions.create(
                **_request(SCRIPT), n=2, stream=True, stream_options=options
            )
            usages = [c.usage async for c in stream if c.usage is not None]
        *running, final = usages
        assert final.completion_tokens_details is not None
        assert final.completion_tokens_details.reasoning_tokens == 2 * expected
        counts = []
        for usage in running:
            assert usage.completion_tokens_details is not None, usage
            counts.append(usage.completion_tokens_details.reasoning_tokens)
            assert counts[-1] <= usage.completion_tokens
        assert counts == sorted(counts) and counts[-1] == 2 * expected
        if expected:  # counted as it came, not only at the end
            assert any(0 < count < 2 * expected for count in counts)


async def test_a_block_never_closed_is_all_reasoning() -> None:
    script = "<think>\nHmm, let me think about this for a long time"
    async with _client(script) as (client, _):
        request = _request(script, max_tokens=30)
        whole = await client.chat.completions.create(**request)
        streamed = await _streamed(client, **request)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.model_extra == reasoning_fields(script[8:30])
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 30  # every token
    assert streamed[0]["reasoning"] == script[8:30] and streamed[0]["content"] in (None, "")
    assert streamed[0]["finishes"] == ["length"]


async def test_thinking_off_leaves_the_whole_reply_content() -> None:
    script = "<think>not a block here</think> Answer"
    async with _client(script) as (client, _):
        request = _request(script, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        whole = await client.chat.completions.create(**request)
        streamed = await _streamed(client, **request)
    assert whole.choices[0].message.content == script
    assert whole.choices[0].message.model_extra == reasoning_fields(None)  # no block to read
    assert streamed[0]["content"] == script and streamed[0]["reasoning"] == ""


async def test_a_prompt_that_opens_the_block_starts_the_reply_inside_it() -> None:
    script = "Two and two.\n</think>\n\nFour."
    async with _client(script, reasoning_parser="deepseek_r1") as (client, _):
        whole = await client.chat.completions.create(**_request(script))
        streamed = await _streamed(client, **_request(script))
    assert whole.choices[0].message.model_extra == reasoning_fields("Two and two.")
    assert whole.choices[0].message.content == "Four."
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == ("Two and two.", "Four.")


async def test_continuing_a_final_message_left_in_its_block_continues_the_block() -> None:
    """continue_final_message on an assistant turn whose block is open: the reply goes on with the
    reasoning, and its end tag is not content (as vLLM's qwen3 parser reads a reply that only
    closes a block); a turn whose block is closed, or that has none, is continued as before."""
    script = "and two is four.\n</think>\n\nFour."
    partial: Any = [*ASK, {"role": "assistant", "content": "<think>\nTwo"}]
    extra: Any = {"add_generation_prompt": False, "continue_final_message": True}
    async with _client(script) as (client, _):
        request = _request(script, messages=partial, extra_body=extra)
        whole = await client.chat.completions.create(**request)
        streamed = await _streamed(client, **request)
        closed: Any = [*ASK, {"role": "assistant", "content": "<think>Two</think>Four"}]
        after = await client.chat.completions.create(**_request(script, messages=closed, extra_body=extra))
    assert whole.choices[0].message.model_extra == reasoning_fields("and two is four.")
    assert whole.choices[0].message.content == "Four."
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == ("and two is four.", "Four.")
    assert after.choices[0].message.content == script  # qwen3: a reply that opens no block is content


async def test_include_reasoning_false_leaves_it_out() -> None:
    async with _client(SCRIPT) as (client, _):
        request = _request(SCRIPT, extra_body={"include_reasoning": False})
        whole = await client.chat.completions.create(**request)
        streamed = await _streamed(client, **request)
    assert whole.choices[0].message.model_extra == {}
    assert whole.choices[0].message.content is not None and THOUGHT not in whole.choices[0].message.content
    assert streamed[0]["reasoning"] == "" and streamed[0]["content"] == whole.choices[0].message.content
    async with _client(SCRIPT, reasoning_parser=None) as (client, _):
        with pytest.raises(openai.BadRequestError, match="--reasoning-parser") as info:
            await client.chat.completions.create(**request)
        assert info.value.body["param"] == "include_reasoning"  # type: ignore[index]


async def test_reasoning_sent_back_in_history_reaches_the_template() -> None:
    async with _client("ok") as (client, engine):
        for field in ("reasoning_content", "reasoning"):
            history: Any = [*ASK, {"role": "assistant", "content": "Sunny.", field: "I looked."}, *ASK]
            tokens = await client.with_options(base_url="http://127.0.0.1").post(
                "/tokenize", body={"model": MODEL, "messages": history}, cast_to=httpx.Response
            )
            prompt = engine.tokenizer.decode(tokens.json()["tokens"])
            assert "<assistant><think>I looked.</think>Sunny." in prompt


async def test_a_json_schema_holds_after_the_reasoning_block(tiny_model_dir: pathlib.Path) -> None:
    """A real engine on random weights, with the grammar composed for a reasoning reply (an
    optional block, then the document): the replies that open no block are the document, streamed
    or not. (Random weights never write a block's end tag; tests/server/test_reasoning.py checks
    the composed grammar on texts with blocks, on the same tokenizer.)"""
    async with openai_client(tiny_model_dir, reasoning_parser="qwen3") as client:
        request: Any = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "A person, please."}],
            "max_tokens": 48,
            "n": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        }
        for seed in range(2):
            whole = await client.chat.completions.create(**request, seed=seed)
            streamed = await _streamed(client, **request, seed=seed)
            for choice in whole.choices:
                assert choice.finish_reason == "stop"
                assert (choice.message.model_extra or {})["reasoning_content"] is None
                document = choice.message.content or ""
                assert 0 <= json.loads(document)["age"] <= 99
                assert document == json.dumps(json.loads(document), separators=(",", ":"))  # no padding
                got = streamed[choice.index]
                assert (got["reasoning"], got["content"]) == ("", choice.message.content)


PERSON = {
    "type": "object",
    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["age"],
    "additionalProperties": False,
}


async def test_a_responses_reply_has_its_reasoning_block_as_a_reasoning_item() -> None:
    """The block is a reasoning item before the message and the call, whole, as raw events (one
    item open at a time, each index and sequence number in order), through the client's own
    accumulator and `.parse()`; the call is read from the answer, its ids OpenAI's; the usage
    counts the block; the output sent back as input gives the template the reasoning again."""
    async with _client(SCRIPT, tool_call_parser="hermes") as (client, engine):
        tools: Any = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
        asked: Any = {
            "model": MODEL,
            "input": "Weather in Paris?",
            "tools": tools,
            "max_output_tokens": len(SCRIPT) + 1,
            "extra_body": {"stop": [END]},
        }
        whole = await client.responses.create(**asked)
        stream = await client.responses.create(**asked, stream=True)
        events = [e async for e in stream]
        async with client.responses.stream(**asked) as helper:
            accumulated = await helper.get_final_response()
        parsed = await client.responses.parse(**asked)
        # The output sent back, as OpenAI advises: the reasoning reaches the template again.
        rendered: list[str] = []
        render = engine.tokenizer.apply_chat_template

        def recorded(*args: Any, **kwargs: Any) -> str:
            rendered.append(render(*args, **kwargs))
            return rendered[-1]

        engine.tokenizer.apply_chat_template = recorded  # type: ignore[method-assign]
        call_id = whole.output[-1].call_id  # type: ignore[union-attr]
        history: Any = [
            {"role": "user", "content": "Weather in Paris?"},
            *[o.model_dump(exclude_none=True) for o in whole.output],
            {"type": "function_call_output", "call_id": call_id, "output": "sunny"},
        ]
        await client.responses.create(**{**asked, "input": history})
    assert f"<assistant><think>{THOUGHT}</think>Let me check.\n<tool>sunny" in rendered[0]
    streamed = events[-1]
    assert streamed.type == "response.completed"
    for response in (whole, streamed.response, accumulated, parsed):
        assert [i.type for i in response.output] == ["reasoning", "message", "function_call"]
        reasoning, _, call = response.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
        assert [(c.type, c.text) for c in reasoning.content or []] == [("reasoning_text", THOUGHT)]
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert response.output_text == "Let me check."
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == len(f"<think>\n{THOUGHT}\n</think>")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in deltas) == THOUGHT and {e.output_index for e in deltas} == {0}
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    first_delta = kinds.index(("response.reasoning_text.delta", 0))
    assert kinds[2:first_delta] == [("response.output_item.added", 0), ("response.content_part.added", 0)]
    end = kinds.index(("response.output_item.added", 1))
    assert kinds[end - 3 : end] == [
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
    ]
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == THOUGHT and done.item_id == streamed.response.output[0].id


@pytest.fixture(scope="module")
def special_think_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The demo model's tokenizer with `<think>` and `</think>` added as special tokens (as some
    reasoning models' tokenizers have them), and its config: all the simulator reads."""
    model_dir = write_demo_model(tmp_path_factory.mktemp("models") / "think", arch="llama", weights=False)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(tag, special=True) for tag in ("<think>", "</think>")])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


async def test_think_tags_that_are_special_tokens_still_split_the_reply(
    special_think_dir: pathlib.Path,
) -> None:
    """skip_special_tokens (on by default) leaves special tokens out of a reply's text, but not the
    tags the reasoning parser reads (vLLM's parsers find them by token id): whole, streamed, in
    /v1/responses, and in the usage. The simulator's reply repeats its prompt, here the user's turn."""
    said = "<think>I ponder.</think>The answer."
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    [engine] = build_engines(ReplicaSpec(PROFILE, special_think_dir, MODEL), 1)
    ids = engine.tokenizer.encode(said, add_special_tokens=False)
    assert len(engine.tokenizer.encode("<think></think>", add_special_tokens=False)) == 2  # one token each
    app = create_app(engine, reasoning_parser="qwen3", chat_template=template)
    request: Any = {"model": MODEL, "messages": [{"role": "user", "content": said}], "max_tokens": len(ids)}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="x", http_client=http, max_retries=0
            )
            whole = await client.chat.completions.create(**request)
            streamed = await _streamed(client, **request)
            response = await client.responses.create(model=MODEL, input=said, max_output_tokens=len(ids))
    assert whole.choices[0].message.model_extra == reasoning_fields("I ponder.")
    assert whole.choices[0].message.content == "The answer."
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == ("I ponder.", "The answer.")
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    through_end = engine.tokenizer.encode("<think>I ponder.</think>", add_special_tokens=False)
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(through_end)
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert response.output_text == "The answer."
