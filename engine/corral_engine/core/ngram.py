"""N-gram (prompt lookup) speculation: propose the tokens that followed the sequence's latest n-gram
the last time it occurred in its own prompt or output. Cheap, model-free, and strong on outputs that
repeat their input (summaries, code edits, extraction)."""

from __future__ import annotations

MAX_NGRAM = 3
MIN_NGRAM = 2  # 1-token matches propose mostly wrong drafts (bench/engine/spec_decode.py)


def propose(
    token_ids: list[int],
    max_proposals: int,
    lookback: int = 1024,
    min_ngram: int = MIN_NGRAM,
    max_ngram: int = MAX_NGRAM,
) -> list[int]:
    """Up to `max_proposals` draft tokens; [] when no n-gram of length min_ngram..max_ngram recurs.
    Longer n-grams are tried first."""
    if max_proposals < 1:
        return []
    window = token_ids[-lookback:]
    n_total = len(window)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n_total <= n:
            continue
        tail = window[-n:]
        last = tail[-1]
        # Latest earlier occurrence, scanning backwards (recent context predicts best).
        for start in range(n_total - n - 1, -1, -1):
            if window[start + n - 1] == last and window[start : start + n] == tail:
                follow = window[start + n : start + n + max_proposals]
                if follow:
                    return follow
    return []
