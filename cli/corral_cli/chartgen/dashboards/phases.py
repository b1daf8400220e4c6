"""The deployment dashboard's row on request phases and speculative decoding: where a request's engine
time goes, and what n-gram drafts save (acceptance as vLLM defines it)."""

from __future__ import annotations

from corral_engine import wire

from corral_cli.chartgen.dashboards.panels import ENGINE_MODEL, REPLICA, engine, quantiles, ratio
from corral_cli.chartgen.grafana import Panel, Row, Target, rate, sum_by


def phases_row() -> Row:
    """Where a request's engine time goes, and what speculative decoding saves (deployment view)."""
    r, m = REPLICA, ENGINE_MODEL
    iteration = wire.ITERATION_TOKENS_TOTAL
    return Row(
        "Request phases and speculative decoding",
        (
            Panel(
                "Prefill and decode time",
                "Per request: first scheduled to first token (prefill), first to last token (decode); "
                "p50 and p99.",
                quantiles(wire.REQUEST_PREFILL_TIME_SECONDS, m, "prefill")
                + quantiles(wire.REQUEST_DECODE_TIME_SECONDS, m, "decode"),
                unit="s",
                width=8,
            ),
            Panel(
                "Time per output token per request",
                "Each request's decode time over its output tokens after the first (p50, p99).",
                quantiles(wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS, r, "{{instance}}"),
                unit="s",
                width=8,
            ),
            Panel(
                "Tokens per engine step",
                "Mean tokens computed per step (prompt chunks, decodes and drafts): how full batches are.",
                (Target(ratio(iteration + "_sum", iteration + "_count", r), "{{instance}}"),),
                width=8,
            ),
            *_speculative_panels(),
        ),
    )


def _speculative_panels() -> tuple[Panel, ...]:
    """What n-gram drafts save: acceptance (of draft tokens, by draft, by position), and draft tokens a
    second (no data, or NaN, without --speculative)."""
    r = REPLICA
    return (
        Panel(
            "Speculative draft acceptance",
            "Share of n-gram draft tokens the model accepted (no data without --speculative).",
            (
                Target(
                    ratio(
                        wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL,
                        wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL,
                        r,
                    ),
                    "{{instance}}",
                ),
            ),
            unit="percentunit",
            max_value=1.0,
            width=6,
            is_event_driven=True,
        ),
        *_acceptance_panels(),
        Panel(
            "Speculative draft tokens/s",
            "Draft tokens verified and accepted per second.",
            (
                Target(
                    sum_by(r, rate(engine(wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL))),
                    "{{instance}} drafted",
                ),
                Target(
                    sum_by(r, rate(engine(wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL))),
                    "{{instance}} accepted",
                ),
            ),
            width=6,
        ),
    )


def _acceptance_panels() -> tuple[Panel, Panel]:
    """Mean acceptance length and acceptance rate by draft position, per model, as vLLM defines them."""
    m = ENGINE_MODEL
    drafts = sum_by(m, rate(engine(wire.SPEC_DECODE_NUM_DRAFTS_TOTAL)))
    accepted = sum_by(m, rate(engine(wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL)))
    per_pos = sum_by(f"{m}, position", rate(engine(wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL)))
    return (
        Panel(
            "Mean acceptance length",
            "Tokens a verified draft yields: 1 + accepted tokens / drafts (NaN without --speculative).",
            (Target(f"1 + {accepted} / {drafts}", "{{model_name}}"),),
            width=6,
            is_event_driven=True,
        ),
        Panel(
            "Acceptance rate by draft position",
            "Share of drafts whose token at this position was accepted (0 = first; no series without "
            "--speculative).",
            # group_left: each position's rate over its model's one drafts rate.
            (Target(f"{per_pos} / on ({m}) group_left {drafts}", "{{model_name}} position {{position}}"),),
            unit="percentunit",
            max_value=1.0,
            width=6,
            is_event_driven=True,
        ),
    )
