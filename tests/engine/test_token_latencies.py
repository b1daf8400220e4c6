"""Token latencies taken where the tokens are made (`StepLatencies`), and final-only requests.

The time-to-first-token and inter-token-latency histograms read each step's latencies, so they
see every token's own gap however few outputs reach the server: a stream interval that holds
tokens back, a final-only request with one output at its end."""

from __future__ import annotations

import itertools
import pathlib

import pytest
from corral_engine import SamplingParams
from corral_engine.llm_engine import LLMEngine
from corral_engine.outputs import RequestMetrics, RequestOutput, StepLatencies
from corral_engine.settings import EngineSettings

from tests.engine.helpers import make_engine, random_prompts


def test_tokens_made_keeps_the_first_token_time_then_each_gap() -> None:
    metrics = RequestMetrics(arrival_time=10.0)
    step = StepLatencies()
    assert step.tokens_made(metrics, 10.5, 1) is True
    assert step.tokens_made(metrics, 10.5, 1) is False  # the request's second sequence, same step
    assert (step.ttft_s, step.itl_s) == ([0.5], [])
    assert (metrics.first_token_time, metrics.last_token_time) == (10.5, 10.5)

    step = StepLatencies()
    assert step.tokens_made(metrics, 10.75, 1) is False
    assert step.tokens_made(metrics, 10.75, 2) is False  # the other sequence: counted once
    assert (step.ttft_s, step.itl_s) == ([], [0.25])
    step = StepLatencies()
    step.tokens_made(metrics, 11.75, 4)  # one draft step made four tokens: the gap split over them
    assert step.itl_s == [0.25] * 4
    assert (metrics.first_token_time, metrics.last_token_time) == (10.5, 11.75)


def _run(
    engine: LLMEngine, request_id: str
) -> tuple[list[RequestOutput], list[float], list[float], list[float]]:
    """Step until done: outputs, every step's TTFTs and gaps, and the request's last token time
    after each step that made tokens (read from the engine, not from the outputs)."""
    outputs: list[RequestOutput] = []
    ttfts: list[float] = []
    gaps: list[float] = []
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        request = engine.requests.get(request_id)
        outputs += engine.step()
        ttfts += engine.last_step_latencies.ttft_s
        gaps += engine.last_step_latencies.itl_s
        last = request.metrics.last_token_time if request is not None else None
        if last is not None and (not stamps or stamps[-1] != last):
            stamps.append(last)
    return outputs, ttfts, gaps, stamps


@pytest.mark.parametrize(
    ("stream_interval", "output_kind"), [(1, "delta"), (4, "delta"), (1, "final_only"), (4, "cumulative")]
)
def test_every_step_gap_is_kept_however_few_outputs_go_out(
    tiny_model_dir: pathlib.Path, stream_interval: int, output_kind: str
) -> None:
    engine = make_engine(tiny_model_dir, stream_interval=stream_interval)
    prompt = random_prompts(1, 500, seed=11, min_len=9, max_len=9)[0]
    params = SamplingParams(
        n=2,
        max_tokens=10,
        temperature=1.0,
        seed=2,
        ignore_eos=True,
        output_kind=output_kind,  # type: ignore[arg-type]
    )
    engine.add_request("r", prompt, params)
    outputs, ttfts, gaps, stamps = _run(engine, "r")

    metrics = outputs[-1].metrics
    assert metrics.first_token_time is not None
    assert len(stamps) >= 10  # ten tokens per sequence (the second one forks after the first token)
    assert ttfts == [metrics.first_token_time - metrics.arrival_time]
    # One gap per step after the first (not per sequence), each the step's own.
    assert gaps == [later - earlier for earlier, later in itertools.pairwise(stamps)]
    if output_kind == "final_only":
        assert len(outputs) == 1
    elif output_kind == "delta" and stream_interval > 1:
        assert 1 < len(outputs) < len(stamps)
    else:
        assert len(outputs) == len(stamps)  # an output per step (cumulative ones are never held)


def test_final_only_sends_one_output_holding_everything(tiny_model_dir: pathlib.Path) -> None:
    """A non-streamed response's request: nothing until the end, then texts, token ids and logprobs
    all in the deltas too, the same completion a cumulative run gives."""
    prompt = random_prompts(1, 500, seed=4, min_len=12, max_len=12)[0]
    base = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=2)
    runs = {}
    for kind in ("cumulative", "final_only"):
        engine = make_engine(tiny_model_dir)
        engine.add_request("r", prompt, base.replace(output_kind=kind))  # type: ignore[arg-type]
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        runs[kind] = outputs
    cumulative = runs["cumulative"]
    (final,) = runs["final_only"]
    assert final.finished
    whole_logprobs = {
        i: [lp for out in cumulative for o in out.outputs if o.index == i for lp in o.delta_logprobs or []]
        for i in range(2)
    }
    for o, whole in zip(final.outputs, cumulative[-1].outputs, strict=True):
        assert (o.text, o.token_ids, o.finish_reason) == (whole.text, whole.token_ids, whole.finish_reason)
        assert len(o.token_ids) == 12 and o.text
        assert (o.delta_text, o.delta_token_ids) == (o.text, o.token_ids)
        assert o.delta_logprobs == whole_logprobs[o.index] and len(o.delta_logprobs) == 12


@pytest.mark.parametrize("async_scheduling", ["0", "1"])
def test_an_aborted_final_only_request_returns_what_it_made(
    tiny_model_dir: pathlib.Path, async_scheduling: str
) -> None:
    settings = EngineSettings(async_scheduling=async_scheduling, overlap_output="0")  # type: ignore[arg-type]
    engine = make_engine(tiny_model_dir, settings=settings)
    prompt = random_prompts(1, 500, seed=6, min_len=8, max_len=8)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, output_kind="final_only")
    engine.add_request("r", prompt, params)
    for _ in range(6):
        assert engine.step() == []
    made = engine.requests["r"].seqs[0].output_token_ids
    final = engine.abort_request("r")
    assert final is not None and final.finished
    (o,) = final.outputs
    assert o.finish_reason == "abort" and o.token_ids == o.delta_token_ids
    assert o.token_ids == [t for t in made if t >= 0] and len(o.token_ids) >= 5
    assert not engine.has_unfinished_requests()
