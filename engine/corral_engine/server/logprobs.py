"""Token logprobs in the two OpenAI shapes: completions (parallel lists) and chat (content list)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from corral_engine.outputs import TokenLogprob

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with a large negative value.
MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def unscored(token_id: int) -> TokenLogprob:
    """A token without a logprob: the prompt's first, with echo (null in the response)."""
    return TokenLogprob(token_id, math.nan, [])


def completion_logprobs(
    items: list[TokenLogprob], num_top: int, token_text: TokenText, shown_text: TokenText, text_offset: int
) -> dict[str, Any]:
    """The `logprobs` object of a completions choice; `text_offset` is where these tokens start in
    the choice's text. Each token's offset indexes that text: a token takes the room `shown_text`
    gives it there, none for a special token the text leaves out (echo's BOS), though `tokens`
    names it."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
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
        offsets.append(text_offset)
        text_offset += len(shown_text(item.token_id))
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
