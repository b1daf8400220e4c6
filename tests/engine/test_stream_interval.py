"""`--stream-interval`: a "delta" request's outputs gather several steps' tokens, and nothing a
client reads is lost or changed: texts, token ids and logprobs add up to the same completion."""

from __future__ import annotations

import pathlib

import pytest
from corral_engine import SamplingParams
from corral_engine.core.sequence import Request, Sequence
from corral_engine.output_processor import OutputProcessor
from corral_engine.outputs import RequestMetrics, RequestOutput
from corral_engine.settings import EngineSettings

from tests.engine.helpers import make_engine, random_prompts


def _request(output_kind: str) -> Request:
    params = SamplingParams(max_tokens=32, output_kind=output_kind)  # type: ignore[arg-type]
    request = Request("r", [1, 2, 3], params, 0, RequestMetrics(arrival_time=0.0))
    request.seqs = [Sequence(7, request, 0, [1, 2, 3], 3)]
    return request


def test_due_sends_the_first_token_then_every_interval_and_the_end() -> None:
    processor = OutputProcessor(None, (), 100, stream_interval=3)
    request = _request("delta")
    assert processor.due(request, {7: 1}, False) == {7: 1}  # the first token goes at once
    assert processor.due(request, {7: 1}, False) is None
    assert processor.due(request, {7: 1}, False) is None
    assert processor.due(request, {7: 1}, False) == {7: 3}  # three since the last output
    assert processor.due(request, {7: 2}, False) is None
    assert processor.due(request, {7: 1}, True) == {7: 3}  # the end takes what was held
    assert request.held_counts is None


def test_due_lets_cumulative_outputs_and_an_interval_of_one_through() -> None:
    cumulative = _request("cumulative")
    processor = OutputProcessor(None, (), 100, stream_interval=4)
    assert [processor.due(cumulative, {7: 1}, False) for _ in range(3)] == [{7: 1}] * 3
    every = OutputProcessor(None, (), 100)
    delta = _request("delta")
    counts = {7: 1}
    assert every.due(delta, counts, False) is counts and every.due(delta, {7: 1}, False) == {7: 1}


# Each way a step's text half can run: in its step, a step later (output overlap), and with the
# next step scheduled before the tokens are known (async scheduling, which greedy sampling allows).
SETTINGS = {
    "sync": EngineSettings(async_scheduling="0", overlap_output="0"),
    "overlap": EngineSettings(async_scheduling="0", overlap_output="1"),
    "ahead": EngineSettings(async_scheduling="1", overlap_output="1"),
}


def _run(
    model_dir: pathlib.Path, interval: int, params: SamplingParams, settings: EngineSettings | None = None
) -> list[RequestOutput]:
    engine = make_engine(model_dir, settings, stream_interval=interval)
    prompt = random_prompts(1, 500, seed=11, min_len=10, max_len=10)[0]
    engine.add_request("r", prompt, params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_an_interval_gathers_tokens_and_loses_nothing(tiny_model_dir: pathlib.Path) -> None:
    params = SamplingParams(
        n=2, max_tokens=13, temperature=1.0, seed=3, ignore_eos=True, logprobs=2, output_kind="delta"
    )
    every = _run(tiny_model_dir, 1, params)
    gathered = _run(tiny_model_dir, 4, params)

    def counts(runs: list[RequestOutput]) -> list[list[int]]:
        return [[len(o.delta_token_ids) for o in out.outputs] for out in runs]

    # The second sequence forks from the first once its prompt is in, a step behind it.
    assert counts(every) == [[1, 0], *[[1, 1]] * 12, [0, 1]]
    # Each sequence's first token and its last at once, four at a time in between.
    assert counts(gathered) == [[1, 0], [1, 1], [4, 4], [4, 4], [3, 3], [0, 1]]
    assert gathered[-1].finished and gathered[-1].outputs == every[-1].outputs
    for index in range(2):
        for runs in (every, gathered):
            seen = [o for out in runs for o in out.outputs if o.index == index]
            assert [t for o in seen for t in o.delta_token_ids] == every[-1].outputs[index].token_ids
            assert "".join(o.delta_text for o in seen) == every[-1].outputs[index].text
        logprobs = [
            [lp for out in runs for o in out.outputs if o.index == index for lp in o.delta_logprobs or []]
            for runs in (every, gathered)
        ]
        assert len(logprobs[0]) == 13 and logprobs[0] == logprobs[1]


@pytest.mark.parametrize("mode", sorted(SETTINGS))
def test_every_step_mode_gathers_the_same_greedy_completion(tiny_model_dir: pathlib.Path, mode: str) -> None:
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, output_kind="delta")
    every = _run(tiny_model_dir, 1, params, SETTINGS["sync"])
    gathered = _run(tiny_model_dir, 3, params, SETTINGS[mode])
    assert [len(out.outputs[0].delta_token_ids) for out in gathered] == [1, 3, 3, 3, 1]
    assert [t for out in gathered for t in out.outputs[0].delta_token_ids] == every[-1].outputs[0].token_ids
    assert "".join(out.outputs[0].delta_text for out in gathered) == every[-1].outputs[0].text


def test_an_abort_sends_the_tokens_held_back(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, stream_interval=8)
    prompt = random_prompts(1, 500, seed=12, min_len=10, max_len=10)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, ignore_eos=True, output_kind="delta"))
    outputs: list[RequestOutput] = []
    for _ in range(5):
        outputs += engine.step()
    final = engine.abort_request("r")
    assert final is not None and final.finished
    assert len(outputs) == 1  # the first token only: the rest waited for the eighth
    sent = [t for out in [*outputs, final] for t in out.outputs[0].delta_token_ids]
    assert len(sent) >= 4 and sent == final.outputs[0].token_ids
