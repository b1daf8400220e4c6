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


def completion_logprobs(
    items: list[TokenLogprob], num_top: int, token_text: TokenText, text_offset: int
) -> dict[str, Any]:
    """The `logprobs` object of a completions choice; `text_offset` is where these tokens start."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for item in items:
        text = token_text(item.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(item.logprob))
        top = {token_text(tid): _finite(lp) for tid, lp in item.top[:num_top]}
        top.setdefault(text, _finite(item.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


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
