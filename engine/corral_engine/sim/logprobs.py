"""Synthetic logprobs for a simulated replica's tokens: well-formed (the token, its rank and the
top k alternatives, best first, in the engine's `TokenLogprob`), plausible, repeatable, and no
model's. The token given is always the likeliest: rank 1, with a probability of 0.5-0.95 drawn
from its id; the alternatives share the rest, each half the one before, so the values descend
and the shown probabilities sum to under 1."""

from __future__ import annotations

import math

from corral_engine.outputs import TokenLogprob

_GOLDEN = 2654435761  # Knuth's multiplicative hash: spreads neighbouring ids


def synthetic_logprob(token_id: int, num_top: int, vocab_size: int, excluded: frozenset[int]) -> TokenLogprob:
    """`token_id` as the likeliest token, with `num_top` entries in `top` (the token first, as the
    engine's top-k lists it); alternatives are other ids, none of `excluded` (special tokens)."""
    p_token = 0.5 + 0.45 * ((token_id * _GOLDEN) % 1000) / 1000
    top: list[tuple[int, float]] = []
    if num_top > 0:
        top.append((token_id, math.log(p_token)))
        rest = 1.0 - p_token
        for alt in _alternatives(token_id, num_top - 1, vocab_size, excluded):
            rest /= 2
            top.append((alt, math.log(rest)))
    return TokenLogprob(token_id, math.log(p_token), top, rank=1)


def _alternatives(token_id: int, count: int, vocab_size: int, excluded: frozenset[int]) -> list[int]:
    """`count` distinct ids other than `token_id` (fewer only when the vocabulary has no more)."""
    out: list[int] = []
    start = (token_id * _GOLDEN) % vocab_size  # a different run of ids for each token
    for j in range(vocab_size):
        if len(out) == count:
            break
        candidate = (start + j) % vocab_size
        if candidate != token_id and candidate not in excluded:
            out.append(candidate)
    return out
