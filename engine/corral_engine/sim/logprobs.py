"""Synthetic logprobs for a simulated replica's tokens: well-formed (the token, its rank and the
top k, best first, in the engine's `TokenLogprob`), plausible, repeatable, and no model's.

The likeliest token gets a probability of 0.5-0.95, drawn from the token's id; each next one half
the one before, so the values descend and the shown probabilities sum to under 1. A greedy
token is the likeliest (rank 1), as an argmax is. A sampled token, or a prompt token scored, is
not always: it is rank 1 70 % of the time, 2 20 %, and 3-12 the rest (drawn from the token and
its position), and the top k lists the likelier tokens before it, as the engine's top-k does."""

from __future__ import annotations

import math

from corral_engine.outputs import TokenLogprob

_GOLDEN = 2654435761  # Knuth's multiplicative hash: spreads neighbouring ids
_MAX_RANK = 12


def synthetic_logprob(
    token_id: int,
    num_top: int,
    vocab_size: int,
    excluded: frozenset[int],
    *,
    is_greedy: bool = True,
    position: int = 0,
) -> TokenLogprob:
    """`token_id` at its drawn rank, with `num_top` entries in `top`: the likeliest first, the token
    among them where its rank is within k; the others are other ids, none of `excluded` (special
    tokens). `position` (the token's index in its sequence) varies a sampled token's rank."""
    p_top = 0.5 + 0.45 * ((token_id * _GOLDEN) % 1000) / 1000
    rank = 1 if is_greedy else _sampled_rank(token_id, position)

    def logprob_at(r: int) -> float:  # rank r's probability: p_top, then (1 - p_top) halved each rank
        return math.log(p_top if r == 1 else (1.0 - p_top) / 2 ** (r - 1))

    ids = _alternatives(token_id, num_top, vocab_size, excluded)
    if rank <= num_top:
        ids.insert(rank - 1, token_id)
    top = [(tid, logprob_at(r)) for r, tid in enumerate(ids[:num_top], start=1)]
    return TokenLogprob(token_id, logprob_at(rank), top, rank=rank)


def _sampled_rank(token_id: int, position: int) -> int:
    u = (((token_id + 1) * _GOLDEN + position * 40503) % 2**32) / 2**32
    if u < 0.7:
        return 1
    if u < 0.9:
        return 2
    return 3 + int((u - 0.9) / 0.1 * (_MAX_RANK - 2))


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
