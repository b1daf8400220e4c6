"""Merging the outputs a slow consumer let pile up (pure)."""

from __future__ import annotations

from corral_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob, merge_outputs


def _out(index: int, ids: list[int], new: int, text: str, delta: str, **kw: object) -> CompletionOutput:
    return CompletionOutput(index, text, ids, delta, ids[-new:] if new else [], **kw)  # type: ignore[arg-type]


def test_merge_joins_deltas_per_sequence_and_keeps_the_later_state() -> None:
    metrics = RequestMetrics(arrival_time=0.0)
    lp = [TokenLogprob(7, -0.5, [])]
    earlier = RequestOutput(
        "r",
        [1, 2],
        [_out(0, [5], 1, "a", "a", delta_logprobs=lp), _out(1, [6], 1, "b", "b")],
        False,
        metrics,
    )
    later = RequestOutput(
        "r",
        [1, 2],
        [
            _out(0, [5, 8], 1, "ac", "c", finish_reason="stop", stop_reason="x"),
            _out(1, [6], 0, "b", ""),  # this sequence made no progress in the later step
        ],
        True,
        metrics,
    )
    merged = merge_outputs(earlier, later)
    first, second = merged.outputs
    assert (first.delta_text, first.delta_token_ids, first.text, first.token_ids) == (
        "ac",
        [5, 8],
        "ac",
        [5, 8],
    )
    assert (first.finish_reason, first.stop_reason) == ("stop", "x")
    assert first.delta_logprobs == lp  # the later output had none: the earlier ones are kept
    assert (second.delta_text, second.delta_token_ids, second.delta_logprobs) == ("b", [6], None)
    assert merged.finished and merged.metrics is metrics and merged.request_id == "r"


def test_merge_keeps_the_later_outputs_prompt_logprobs() -> None:
    # A request's final output carries its prompt's logprobs; a non-streamed request whose reader
    # fell behind got that output merged with an earlier one, and lost them.
    metrics = RequestMetrics(arrival_time=0.0)
    scored = [None, TokenLogprob(2, -1.0, [])]
    earlier = RequestOutput("r", [1, 2], [_out(0, [5], 1, "a", "a")], False, metrics, scored)
    final = _out(0, [5, 6], 1, "ab", "b", finish_reason="length")
    later = RequestOutput("r", [1, 2], [final], True, metrics, scored)
    assert merge_outputs(earlier, later).prompt_logprobs == scored
