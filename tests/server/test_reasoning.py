"""--reasoning-parser's reading of replies: where a reply begins (from its prompt's end), the
reasoning and content a whole reply splits into, the same split however its text is streamed, and
reasoning kept apart from tool calls and grammars (which hold after the block), and the tokens a
reply spent in its block."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from corral_engine.args import REASONING_PARSERS as PARSER_NAMES
from corral_engine.demo_model import write_demo_model
from corral_engine.server.api_tools import ToolPlan
from corral_engine.server.reasoning import (
    REASONING_PARSERS,
    Reasoning,
    ReasoningCount,
    ReasoningPlan,
    num_reasoning_tokens,
    plan_reasoning,
    reasoning_fields,
    split_whole,
)
from corral_engine.server.tool_calls import ReplyStream, reply_message
from corral_engine.server.tool_parsers import Content, HermesParser
from corral_engine.structured.spec import GrammarSpec

QWEN3 = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING = QWEN3 + "<think>\n\n</think>\n\n"
R1 = "<｜User｜>Hi<｜Assistant｜><think>\n"


def _plan(name: str, prompt: str) -> ReasoningPlan:
    plan = plan_reasoning(name, prompt)
    assert plan is not None
    return plan


def test_the_parser_names_are_the_engine_options_choices() -> None:
    assert set(PARSER_NAMES) == set(REASONING_PARSERS)


def test_where_a_reply_begins_is_read_from_its_prompt() -> None:
    assert plan_reasoning(None, R1) is None
    assert plan_reasoning("qwen3", QWEN3_NO_THINKING) is None  # enable_thinking false: all content
    assert plan_reasoning("deepseek_r1", QWEN3_NO_THINKING) is None
    assert _plan("qwen3", R1).is_inside  # the template opened the block (Qwen3 thinking-2507 too)
    assert not _plan("qwen3", QWEN3).is_inside  # the model opens it, or answers directly
    assert _plan("deepseek_r1", QWEN3).is_inside  # R1 may leave the start tag out


@pytest.mark.parametrize(
    ("name", "prompt", "reply", "reasoning", "content"),
    [
        (
            "qwen3",
            QWEN3,
            "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
            "Let me see.",
            "The answer is 4.",
        ),
        ("qwen3", QWEN3, "The answer is 4.", None, "The answer is 4."),
        ("qwen3", QWEN3, "  \n<think>x</think>y", "x", "y"),
        (
            "qwen3",
            QWEN3,
            "<think>\nStill thinking, cut off by max_tok",
            "Still thinking, cut off by max_tok",
            "",
        ),
        ("qwen3", QWEN3, "<thi", None, "<thi"),  # a start tag cut off is what was written
        ("qwen3", QWEN3, "<b>bold</b>", None, "<b>bold</b>"),
        ("qwen3", R1, "Hmm.\n</think>\n\nFour.", "Hmm.", "Four."),
        ("deepseek_r1", R1, "Hmm.\n</think>\n\nFour.", "Hmm.", "Four."),
        ("deepseek_r1", R1, "<think>\nHmm.</think>Four.", "Hmm.", "Four."),  # a repeated start tag
        ("deepseek_r1", QWEN3, "Hmm.</think>Four.", "Hmm.", "Four."),
        ("deepseek_r1", QWEN3, "Never closed", "Never closed", ""),
        ("qwen3", QWEN3, "<think>a</think>b</think>c", "a", "b</think>c"),  # the first end tag ends it
        ("qwen3", QWEN3, "<think>\n</think>\n\nOK", None, "OK"),  # an empty block
        ("qwen3", QWEN3, "<think>a < b, and </thin is not </think>Done", "a < b, and </thin is not", "Done"),
    ],
)
def test_a_reply_splits_into_reasoning_and_content(
    name: str, prompt: str, reply: str, reasoning: str | None, content: str
) -> None:
    plan = _plan(name, prompt)
    assert split_whole(plan, reply) == (reasoning, content)
    # Fed in any two pieces, or a character at a time, the events add up to the same.
    for cut in range(len(reply) + 1):
        _assert_adds_up(plan, [reply[:cut], reply[cut:]], reasoning, content)
    _assert_adds_up(plan, list(reply), reasoning, content)


def _assert_adds_up(plan: ReasoningPlan, pieces: list[str], reasoning: str | None, content: str) -> None:
    splitter = plan.splitter()
    events = [e for piece in pieces for e in splitter.feed(piece)] + splitter.finish()
    assert all(e.text for e in events)  # no empty deltas
    kinds = [type(e) for e in events]
    assert Reasoning not in kinds[kinds.index(Content) :] if Content in kinds else True  # reasoning first
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == (reasoning or "")
    assert "".join(e.text for e in events if isinstance(e, Content)) == content


def test_no_reasoning_is_sent_before_the_end_tag_is_ruled_out() -> None:
    splitter = _plan("deepseek_r1", R1).splitter()
    assert splitter.feed("Think ") == [Reasoning("Think")]  # a space may precede the end tag
    assert splitter.feed("hard </thi") == [Reasoning(" hard")]
    assert splitter.feed("nk>\n\nDone") == [Content("Done")]


def test_tool_calls_are_read_from_the_content_only() -> None:
    tools = ToolPlan(None, HermesParser)
    reply = (
        '<think>I could write <tool_call>{"name": "nope", "arguments": {}}</tool_call> here.</think>\n'
        'On it.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    message = reply_message(tools, reply, _plan("qwen3", QWEN3))
    assert message["reasoning_content"].startswith("I could write <tool_call>")
    assert message["content"] == "On it."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    stream = ReplyStream(tools, _plan("qwen3", QWEN3))
    deltas = [d for ch in reply for d in stream.feed(ch, False)] + stream.feed("", True)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "On it."
    names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert names == ["get_weather"] and stream.has_calls


def test_a_named_call_is_announced_only_once_the_reasoning_is_over() -> None:
    stream = ReplyStream(ToolPlan(None, None, named="get_weather"), _plan("deepseek_r1", R1))
    assert stream.feed("Paris, I think.", False) == [reasoning_fields("Paris, I think.")]
    deltas = stream.feed('</think>{"city": "Paris"}', True)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"] == {"arguments": '{"city": "Paris"}'}


def test_reasoning_left_out_on_request_is_neither_sent_nor_returned() -> None:
    plan = plan_reasoning("qwen3", QWEN3, is_shown=False)
    assert plan is not None
    message = reply_message(ToolPlan(None, None), "<think>secret</think>Hello", plan)
    assert message == {"role": "assistant", "content": "Hello"}
    stream = ReplyStream(ToolPlan(None, None), plan)
    assert stream.feed("<think>secret</think>Hel", False) == [{"content": "Hel"}]


def test_a_reply_that_is_all_reasoning_has_null_content() -> None:
    message = reply_message(ToolPlan(None, None), "thinking...", _plan("deepseek_r1", R1))
    assert message == {"role": "assistant", "content": None, **reasoning_fields("thinking...")}
    message = reply_message(ToolPlan(None, None), "Just an answer", _plan("qwen3", QWEN3))
    assert message == {"role": "assistant", "content": "Just an answer", **reasoning_fields(None)}


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("prompt", "text", "is_accepted"),
    [
        (R1, 'Count.\n</think>\n\n{"n":4}', True),
        (R1, '{"n":4}', False),  # inside the block, JSON is reasoning: the block must still end
        (R1, 'a</think>b</think>{"n":4}', False),  # the first end tag ends the block
        (QWEN3, '<think>\nCount.</think>\n{"n":4}', True),
        (QWEN3, '{"n":4}', True),  # no block at all
        (QWEN3, ' \n{"n":4}', False),  # and no white space before the document either
        (QWEN3, '<think>a</think>\n\n\n\n\n\n{"n":4}', False),  # nor much after the block
        (QWEN3, 'Count.</think>{"n":4}', False),  # a qwen3 block opens with its start tag
    ],
)
def test_a_grammar_holds_after_the_reasoning_block(
    tiny_model_dir: pathlib.Path, prompt: str, text: str, is_accepted: bool
) -> None:
    from corral_engine.structured.compiler import GrammarCompiler
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    grammar = _plan("qwen3", prompt).constrain(GrammarSpec.json_schema(SCHEMA, "response_format"))
    matcher = compiler.matcher(grammar)
    is_consumed = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert (is_consumed and matcher.is_accepting()) == is_accepted


@pytest.fixture(scope="module")
def special_tags_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The demo tokenizer with `<think>` and `</think>` added as special tokens, as some reasoning
    models' tokenizers have them."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer

    model_dir = write_demo_model(tmp_path_factory.mktemp("models") / "think", arch="llama", weights=False)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(tag, special=True) for tag in ("<think>", "</think>")])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize(
    ("name", "prompt", "text", "is_accepted"),
    [
        ("qwen3", QWEN3, '<think>\nCount.</think>\n{"n":4}', True),
        ("qwen3", QWEN3, '<think></think>{"n":4}', True),
        ("qwen3", QWEN3, '{"n":4}', True),
        ("qwen3", QWEN3, 'Count.</think>{"n":4}', False),
        ("qwen3", QWEN3, '<think>a</think>b</think>{"n":4}', False),
        ("deepseek_r1", R1, 'Count.\n</think>\n\n{"n":4}', True),
        ("deepseek_r1", R1, '</think>{"n":4}', True),
        ("deepseek_r1", R1, '{"n":4}', False),
    ],
)
def test_a_grammar_holds_after_a_block_whose_tags_are_special_tokens(
    special_tags_tokenizer: Any, name: str, prompt: str, text: str, is_accepted: bool
) -> None:
    """A tag that is a special token is written as that token, which text never holds: the
    grammar reads it by id, as vLLM's parsers do."""
    from corral_engine.structured.compiler import GrammarCompiler

    tokenizer = special_tags_tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.encode("<think></think>", add_special_tokens=False)) == 2  # a token each
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    matcher = compiler.matcher(
        _plan(name, prompt).constrain(GrammarSpec.json_schema(SCHEMA, "response_format"))
    )
    is_consumed = all(matcher.consume_token(t) for t in ids)
    assert (is_consumed and matcher.is_accepting()) == is_accepted


# Tokens of several characters, tags split across them, as real tokenizers split `</think>`.
PIECES = ["<th", "ink>", "Hmm", ", ok", "</", "think", ">", "\n\n", "Hi", "!"]


def _text(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize(
    ("name", "prompt", "ids", "expected"),
    [
        ("qwen3", QWEN3, list(range(10)), 7),  # through the token that ends `</think>`
        ("qwen3", QWEN3, [8, 9], 0),  # no block: content
        ("qwen3", QWEN3_NO_THINKING, list(range(10)), 0),  # thinking off: no block to read
        ("deepseek_r1", R1, [2, 3, 4, 5, 6, 8], 5),  # begun in the prompt
        ("deepseek_r1", R1, [2, 3, 4], 3),  # never closed: all of it
    ],
)
def test_reasoning_tokens_are_those_through_the_blocks_end(
    name: str, prompt: str, ids: list[int], expected: int
) -> None:
    plan = plan_reasoning(name, prompt)
    assert num_reasoning_tokens(plan, _text(ids), ids, PIECES.__getitem__) == expected
    if plan is None:
        return
    # Streamed, in steps of every size: the count so far never falls, never passes the tokens
    # sent, and ends where the whole reply's does.
    for size in range(1, len(ids) + 1):
        count, counts = ReasoningCount(plan, PIECES.__getitem__), []
        for start in range(0, len(ids), size):
            step = ids[start : start + size]
            count.feed(_text(step), step, start + size >= len(ids))
            sent = min(start + size, len(ids))
            counts.append(count.of_first(sent))
            assert counts[-1] <= sent
        assert counts == sorted(counts) and counts[-1] == expected, size
