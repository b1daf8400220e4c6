"""Reasoning read out of chat replies (`--reasoning-parser`): the `<think>...</think>` block a
Qwen3 or DeepSeek-R1 model writes before its answer becomes `reasoning_content`, and only the text
after the block is the reply's content (where tool calls are read).

Where a reply begins is read from the end of its prompt, since templates differ: a prompt ending in
an open block (DeepSeek-R1's and Qwen3 thinking-2507's templates write `<think>`) starts the reply
inside it; one ending in a closed block (Qwen3 with `enable_thinking: false`) has no reasoning at
all; otherwise the reply opens its block itself, or does not (then it is content for `qwen3`, and
reasoning up to the end tag for `deepseek_r1`, whose replies may leave the start tag out). A block
never closed is all reasoning. Whitespace around the block is dropped, as is a start tag repeated
at the start of a reply that begins inside the block. As with tool calls, a reply's events add up
to the same whatever pieces its text came in.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from corral_engine.server.tool_events import held_back
from corral_engine.server.tool_parsers import Content
from corral_engine.structured.spec import GrammarSpec

_WHITESPACE = " \t\r\n"
NUM_PROMPT_TAIL_TOKENS = 32  # of the prompt, decoded to see whether it ends inside a block


# The reply's fields its reasoning goes in: vLLM sends `reasoning` since late 2025 (OpenAI's guidance
# for chain of thought in Chat Completions), while DeepSeek's API and many clients read
# `reasoning_content`; both carry the same text.
REASONING_FIELDS = ("reasoning", "reasoning_content")


def reasoning_fields(text: str | None) -> dict[str, str | None]:
    return dict.fromkeys(REASONING_FIELDS, text)


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


ReasoningEvent = Content | Reasoning


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str
    end: str
    # A reply that opens no block: reasoning up to `end` (True) or plain content (False).
    is_untagged_reasoning: bool


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", is_untagged_reasoning=True),
    "qwen3": ReasoningFormat("<think>", "</think>", is_untagged_reasoning=False),
}


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """How one request's replies split. `is_inside`: they begin in the block (else they may open
    it); `is_shown`: reasoning goes to the client (`include_reasoning`)."""

    format: ReasoningFormat
    is_inside: bool
    is_shown: bool = True

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.format, self.is_inside)

    def constrain(self, grammar: GrammarSpec) -> GrammarSpec:
        """`grammar` applied to the reply's content only: the block comes first, unconstrained."""
        start = None if self.is_inside else self.format.start
        return grammar.after_reasoning(self.format.end, start)


def plan_reasoning(
    parser_name: str | None, prompt_tail: str, is_shown: bool = True, continued: str = ""
) -> ReasoningPlan | None:
    """The plan for a reply to a prompt ending in `prompt_tail`; None when it has no block to read
    (no parser, or the prompt closed the block: thinking is off). `continued`: the text of a final
    message the reply continues (continue_final_message), inside its block if it left one open."""
    if parser_name is None:
        return None
    fmt = REASONING_PARSERS[parser_name]
    tail = prompt_tail.rstrip(_WHITESPACE)
    if tail.endswith(fmt.end):
        return None
    is_left_open = continued.rfind(fmt.start) > continued.rfind(fmt.end)
    is_inside = tail.endswith(fmt.start) or fmt.is_untagged_reasoning or is_left_open
    return ReasoningPlan(fmt, is_inside, is_shown)


class ReasoningSplitter:
    """One reply's text, fed in pieces, as reasoning and content events. Text that may still be
    the start of a tag, or whitespace that may precede the end tag, is held back until it is
    known not to be."""

    def __init__(self, fmt: ReasoningFormat, is_inside: bool) -> None:
        self._fmt = fmt
        self._is_inside = is_inside
        self._part: Literal["lead", "reasoning", "content"] = "lead"
        self._buffer = ""  # text not yet sent
        self._is_trimming = True  # at the start of a part: its leading whitespace is dropped
        self.is_block_closed = False  # its end tag is read

    @property
    def is_in_block(self) -> bool:
        """The reply is in its reasoning block (after `finish`: a block never closed)."""
        return self._part == "reasoning"

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._buffer += text
        out: list[ReasoningEvent] = []
        if self._part == "lead":
            self._lead()
        if self._part == "reasoning":
            self._reasoning(out)
        if self._part == "content":
            self._content(out)
        return out

    def finish(self) -> list[ReasoningEvent]:
        """The reply ended: what was held back (a block never closed is all reasoning)."""
        out: list[ReasoningEvent] = []
        if self._part == "lead" and self._buffer:  # nothing but whitespace or part of a start tag
            self._part = "reasoning" if self._is_inside else "content"
            self._is_trimming = self._part == "reasoning"
        if self._part == "reasoning":
            self._trim()
            if self._buffer:
                out.append(Reasoning(self._buffer))
        elif self._buffer:
            out.append(Content(self._buffer))
        self._buffer = ""
        return out

    def _lead(self) -> None:
        """Before the reply's first text: does it open a block?"""
        head = self._buffer.lstrip(_WHITESPACE)
        if head.startswith(self._fmt.start):
            self._part, self._buffer = "reasoning", head[len(self._fmt.start) :]
        elif not head or self._fmt.start.startswith(head):
            return  # undecided
        elif self._is_inside:
            self._part = "reasoning"
        else:  # untouched: a reply with no block is the model's content as written
            self._part, self._is_trimming = "content", False

    def _trim(self) -> None:
        if self._is_trimming:
            self._buffer = self._buffer.lstrip(_WHITESPACE)
            self._is_trimming = not self._buffer

    def _reasoning(self, out: list[ReasoningEvent]) -> None:
        self._trim()
        end = self._buffer.find(self._fmt.end)
        if end != -1:
            text = self._buffer[:end].rstrip(_WHITESPACE)
            self._buffer = self._buffer[end + len(self._fmt.end) :]
            self._part, self._is_trimming = "content", True
            self.is_block_closed = True
        else:
            cut = len(self._buffer) - held_back(self._buffer, self._fmt.end)
            text = self._buffer[:cut].rstrip(_WHITESPACE)
            self._buffer = self._buffer[len(text) :]
        if text:
            out.append(Reasoning(text))

    def _content(self, out: list[ReasoningEvent]) -> None:
        self._trim()
        if self._buffer:
            out.append(Content(self._buffer))
            self._buffer = ""


def split_whole(plan: ReasoningPlan, text: str) -> tuple[str | None, str]:
    """A whole reply's reasoning (None: it has none) and content."""
    splitter = plan.splitter()
    events = splitter.feed(text) + splitter.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    return reasoning or None, content


def _read(plan: ReasoningPlan, text: str) -> ReasoningSplitter:
    """A splitter that has read the whole of `text`."""
    splitter = plan.splitter()
    splitter.feed(text)
    splitter.finish()
    return splitter


def num_reasoning_tokens(
    plan: ReasoningPlan | None, text: str, token_ids: list[int], token_text: Callable[[int], str]
) -> int:
    """Tokens of a whole reply in its reasoning block, the end tag's included (the usage's
    `reasoning_tokens`): all of them for a block never closed, else those up to the one that
    completes the first end tag. A tag is often several tokens, so it is found in the tokens' own
    texts (`token_text`, cached per token id): no decode of a reply that may be long."""
    if plan is None:
        return 0
    splitter = _read(plan, text)
    if not splitter.is_block_closed:
        return len(token_ids) if splitter.is_in_block else 0
    pieces = list(map(token_text, token_ids))
    found = "".join(pieces).find(plan.format.end)
    if found == -1:  # the tokens' texts alone do not show the tag (a tokenizer's oddity): all
        return len(token_ids)
    return _num_tokens_through(pieces, found + len(plan.format.end))


def _num_tokens_through(pieces: list[str], num_chars: int) -> int:
    """How many of the tokens (their texts, `pieces`) it takes to reach `num_chars` characters."""
    ends = list(itertools.accumulate(map(len, pieces)))  # characters through each token
    return bisect.bisect_left(ends, num_chars) + 1


class ReasoningCount:
    """A streamed reply's reasoning tokens so far, read step by step: for the whole reply, what
    `num_reasoning_tokens` says (the end tag is found in the tokens' own texts, here in each
    step's and the end of those before, so a long reply costs no re-reading)."""

    def __init__(self, plan: ReasoningPlan, token_text: Callable[[int], str]) -> None:
        self._splitter = plan.splitter()
        self._end_tag = plan.format.end
        self._token_text = token_text
        self._tail = ""  # the last characters of the tokens' texts: where an end tag may begin
        self._num_tokens = 0
        self._num_through_end: int | None = None  # tokens through the one completing the end tag
        self._is_finished = False

    def feed(self, text: str, token_ids: list[int], is_last: bool) -> None:
        """One step's text and tokens; `is_last`: the reply has ended."""
        self._splitter.feed(text)
        if is_last:
            self._splitter.finish()
            self._is_finished = True
        if self._num_through_end is None and token_ids:
            pieces = list(map(self._token_text, token_ids))
            joined = self._tail + "".join(pieces)
            found = joined.find(self._end_tag)
            if found != -1:
                through = found + len(self._end_tag) - len(self._tail)  # characters into this step's
                self._num_through_end = self._num_tokens + _num_tokens_through(pieces, through)
            self._tail = joined[max(0, len(joined) - len(self._end_tag) + 1) :]
        self._num_tokens += len(token_ids)

    def of_first(self, num_tokens: int) -> int:
        """How many of the reply's first `num_tokens` tokens (those sent so far) are reasoning."""
        splitter, end = self._splitter, self._num_through_end
        if splitter.is_block_closed:
            return num_tokens if end is None else min(num_tokens, end)
        if not splitter.is_in_block:
            return 0
        return num_tokens if self._is_finished or end is None else min(num_tokens, end)
