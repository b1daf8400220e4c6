"""Token logprobs in the two OpenAI shapes: completions (parallel lists) and chat (content list)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from corral_engine.outputs import TokenLogprob
from corral_engine.tokenizer import IncrementalDetokenizer

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with a large negative value.
MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def unscored(token_id: int) -> TokenLogprob:
    """A token without a logprob: the prompt's first, with echo (null in the response)."""
    return TokenLogprob(token_id, math.nan, [])


class TextRooms:
    """Where tokens fall in the text the detokenizer makes of them (after `context`): the
    characters each one adds there. A special token the text leaves out (echo's BOS) adds none, and
    a character whose bytes span tokens is added by the token that completes it (decoded alone,
    each of them is a U+FFFD, which the text does not hold)."""

    def __init__(
        self, tokenizer: Any, context: list[int], skip_special_tokens: bool = True, spaced: bool = True
    ) -> None:
        """`spaced`: the request's spaces_between_special_tokens, as its text was written with it."""
        self._text = IncrementalDetokenizer(
            tokenizer, context, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaced
        )

    def add(self, token_ids: Iterable[int], is_final: bool) -> list[int]:
        """The room of each token; at the end (`is_final`) an unfinished character goes to the last."""
        rooms = []
        for token_id in token_ids:
            before = len(self._text.text)
            self._text.add_token(token_id)
            rooms.append(len(self._text.text) - before)
        if is_final and rooms:
            before = len(self._text.text)
            self._text.flush()
            rooms[-1] += len(self._text.text) - before
        return rooms


def offsets_of(rooms: list[int], start: int) -> list[int]:
    """Each token's offset in the text, from where the first one starts and each one's room."""
    offsets = []
    for room in rooms:
        offsets.append(start)
        start += room
    return offsets


def completion_logprobs(
    items: list[TokenLogprob], num_top: int, token_text: TokenText, offsets: list[int]
) -> dict[str, Any]:
    """The `logprobs` object of a completions choice; `offsets` are the tokens' offsets in the
    choice's text (see TextRooms); `tokens` names every token, the special ones too."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for item in items:
        text = token_text(item.token_id)
        tokens.append(text)
        if math.isnan(item.logprob):
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_finite(item.logprob))
            top = {token_text(tid): _finite(lp) for tid, lp in item.top[:num_top]}
            top.setdefault(text, _finite(item.logprob))
            top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs_json(
    items: list[TokenLogprob | None], token_text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first), token id -> logprob, rank
    and text, for the token itself and its top alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for item in items:
        if item is None:
            out.append(None)
            continue
        entry = {
            str(tid): {"logprob": _finite(lp), "rank": rank, "decoded_token": token_text(tid)}
            for rank, (tid, lp) in enumerate(item.top, start=1)
        }
        entry[str(item.token_id)] = {
            "logprob": _finite(item.logprob),
            "rank": item.rank,
            "decoded_token": token_text(item.token_id),
        }
        out.append(entry)
    return out


def _chat_entry(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: list[TokenLogprob], num_top: int, token_text: TokenText) -> dict[str, Any]:
    """The `logprobs` object of a chat choice."""
    content = []
    for item in items:
        entry = _chat_entry(item.token_id, item.logprob, token_text)
        entry["top_logprobs"] = [_chat_entry(tid, lp, token_text) for tid, lp in item.top[:num_top]]
        content.append(entry)
    return {"content": content}
