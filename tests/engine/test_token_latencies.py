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
    assert (step.ttft_s, step.itl_s) == ([0.5], [])
    assert (metrics.first_token_time, metrics.last_token_time) == (10.5, 10.5)

    step = StepLatencies()
    assert step.tokens_made(metrics, 10.75, 1) is False
    assert (step.ttft_s, step.itl_s) == ([], [0.25])
    step = StepLatencies()
    step.tokens_made(metrics, 11.75, 4)  # one draft step made four tokens: the gap split over them
    assert step.itl_s == [0.25] * 4
    assert (metrics.first_token_time, metrics.last_token_time) == (10.5, 11.75)


def test_each_sequence_of_n_counts_as_a_request_of_its_own() -> None:
    """vLLM v1's child requests: each sequence has its own first token and gaps; the request's
    times span its sequences'."""
    metrics = RequestMetrics.for_sequences(10.0, 2)
    step = StepLatencies()
    assert step.tokens_made(metrics, 10.5, 1, index=0) is True
    assert (step.ttft_s, step.itl_s) == ([0.5], [])
    step = StepLatencies()
    assert step.tokens_made(metrics, 10.75, 1, index=0) is False
    assert step.tokens_made(metrics, 10.75, 1, index=1) is True  # the fork's first token
    assert (step.ttft_s, step.itl_s) == ([0.75], [0.25])
    step = StepLatencies()
    step.tokens_made(metrics, 11.0, 1, index=0)
    step.tokens_made(metrics, 11.0, 1, index=1)
    assert (step.ttft_s, step.itl_s) == ([], [0.25, 0.25])
    assert metrics.children is not None
    first, second = metrics.children
    assert (first.first_token_time, first.last_token_time) == (10.5, 11.0)
    assert (second.first_token_time, second.last_token_time) == (10.75, 11.0)
    assert (metrics.first_token_time, metrics.last_token_time) == (10.5, 11.0)
    metrics.first_scheduled_time = 10.25
    first.finished_time = 11.0
    metrics.finish(11.5)  # the other one ends with the request, and both take its scheduling
    assert (first.first_scheduled_time, first.finished_time) == (10.25, 11.0)
    assert (second.first_scheduled_time, second.finished_time) == (10.25, 11.5)


def _run(
    engine: LLMEngine, request_id: str
) -> tuple[list[RequestOutput], list[float], list[float], list[list[float]]]:
    """Step until done: outputs, every step's TTFTs and gaps, and each sequence's last token time
    after each step that made it tokens (read from the engine, not from the outputs)."""
    outputs: list[RequestOutput] = []
    ttfts: list[float] = []
    gaps: list[float] = []
    request = engine.requests[request_id]
    children = request.metrics.children or [request.metrics]
    stamps: list[list[float]] = [[] for _ in children]
    while engine.has_unfinished_requests():
        outputs += engine.step()
        ttfts += engine.last_step_latencies.ttft_s
        gaps += engine.last_step_latencies.itl_s
        for child, seen in zip(children, stamps, strict=True):
            last = child.last_token_time
            if last is not None and (not seen or seen[-1] != last):
                seen.append(last)
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
    assert metrics.children is not None and len(metrics.children) == 2
    # Ten tokens per sequence, each at its own step (the second one forks after the first token).
    assert [len(seen) for seen in stamps] == [10, 10]
    # Each sequence is a request of its own (vLLM v1's child requests): its own time to first
    # token, then one gap per step after it, each the step's own.
    assert ttfts == [c.first_token_time - c.arrival_time for c in metrics.children]  # type: ignore[operator]
    assert sorted(gaps) == sorted(b - a for seen in stamps for a, b in itertools.pairwise(seen))
    assert len(gaps) == 2 * 9
    if output_kind == "final_only":
        assert len(outputs) == 1
    elif output_kind == "delta" and stream_interval > 1:
        assert 1 < len(outputs) < len(set(stamps[0] + stamps[1]))
    else:
        assert len(outputs) == len(set(stamps[0] + stamps[1]))  # an output per step that made tokens


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
