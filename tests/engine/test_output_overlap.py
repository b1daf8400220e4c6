"""The output overlap (CORRAL_OVERLAP_OUTPUT): each step's text half (detokenization, stop strings,
outputs) runs in the next step, while the device computes. The outputs must be the plain engine's,
token for token and text for text, each a step later: none lost or repeated, blocks accounted for
after every step, whatever the request asks for."""

from __future__ import annotations

import pathlib
import re

import pytest
from corral_engine import token_appender
from corral_engine.llm_engine import LLMEngine
from corral_engine.output_processor import OutputProcessor
from corral_engine.outputs import RequestOutput
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from corral_engine.structured.spec import GrammarSpec

from tests.engine.helpers import make_engine, random_prompts

OFF, ON = EngineSettings(overlap_output="0"), EngineSettings(overlap_output="1")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
ABORTED = "abort"
Requests = dict[str, tuple[list[int] | str, SamplingParams]]


def _stop_string(text: str) -> str:
    """Three letters from the middle of `text`: a stop string the greedy run will meet."""
    match = re.search(r"[A-Za-z]{3}", text[len(text) // 3 :])
    assert match is not None
    return match.group()


def _requests(model_dir: pathlib.Path) -> tuple[Requests, dict[str, list[int]]]:
    """A batch asking for everything the text half touches, and each prompt's greedy continuation."""
    prompts = random_prompts(9, 500, seed=21, min_len=6, max_len=20)
    engine = make_engine(model_dir, settings=OFF)
    reference = engine.generate(prompts, GREEDY)
    text = [r.outputs[0].text for r in reference]
    eos = engine.eos_token_ids[0]
    requests: Requests = {
        "stop": (prompts[0], GREEDY.replace(stop=(_stop_string(text[0]),))),
        "stop-included": (
            prompts[1],
            GREEDY.replace(
                stop=(_stop_string(text[1]),), include_stop_str_in_output=True, output_kind="delta"
            ),
        ),
        "stop-token": (prompts[2], GREEDY.replace(stop_token_ids=(reference[2].outputs[0].token_ids[5],))),
        "eos": (prompts[3], GREEDY.replace(ignore_eos=False, min_tokens=4, logit_bias=((eos, 100.0),))),
        "length-logprobs": (prompts[4], GREEDY.replace(max_tokens=7, logprobs=2)),
        "n": (
            prompts[5],
            SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=5, stop=("e",), ignore_eos=True),
        ),
        "prompt-logprobs": (prompts[6], GREEDY.replace(max_tokens=5, prompt_logprobs=2)),
        "json": (
            "request number 1",
            SamplingParams(max_tokens=40, seed=1, grammar=GrammarSpec.json_schema(SCHEMA, "t")),
        ),
        ABORTED: (prompts[7], GREEDY.replace(max_tokens=100)),
        # Outlives the JSON request (up to 40 tokens, whose steps cannot run ahead), so async
        # scheduling has steps to run ahead whatever the sampled JSON's length.
        "plain": (prompts[8], GREEDY.replace(output_kind="delta", max_tokens=48)),
    }
    continuations = {
        rid: reference[i].outputs[0].token_ids for i, rid in enumerate(["stop", "stop-included"])
    }
    continuations[ABORTED] = reference[7].outputs[0].token_ids
    return requests, continuations


def _run(
    engine: LLMEngine, requests: Requests, abort_after: int = 0
) -> tuple[dict[str, list[RequestOutput]], int]:
    """Step `requests` to the end, checking block accounting after every step; every output of
    each request in order, and the number of steps. `abort_after`: abort ABORTED after that step."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in requests}
    num_steps = 0
    while engine.has_unfinished_requests():
        assert num_steps < 500, "the engine never finished"
        step_outputs = engine.step()
        num_steps += 1
        if num_steps == abort_after:
            aborted = engine.abort_request(ABORTED)
            assert aborted is not None
            step_outputs.append(aborted)
        for out in step_outputs:
            seen = outputs[out.request_id]
            assert not (seen and seen[-1].finished), f"{out.request_id}: an output after its final one"
            seen.append(out)
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(seen and seen[-1].finished for seen in outputs.values()), "a final output is missing"
    return outputs, num_steps


def _streamed(outputs: list[RequestOutput]) -> list[object]:
    """A request's result: per completion its final fields and its deltas joined (checked to add up
    to the final text and token ids), then the prompt logprobs."""
    final = outputs[-1]
    result: list[object] = []
    for whole in final.outputs:
        seen = [o for out in outputs for o in out.outputs if o.index == whole.index]
        assert "".join(o.delta_text for o in seen) == whole.text
        assert [t for o in seen for t in o.delta_token_ids] == whole.token_ids
        logprobs = [
            (lp.token_id, lp.rank, [t for t, _ in lp.top]) for o in seen for lp in o.delta_logprobs or []
        ]
        result.append(
            (whole.index, whole.text, whole.token_ids, whole.finish_reason, whole.stop_reason, logprobs)
        )
    prompt_logprobs = final.prompt_logprobs or []
    result.append([(lp.token_id, lp.rank) if lp else None for lp in prompt_logprobs])
    return result


def _each_output(outputs: list[RequestOutput]) -> list[object]:
    return [
        [
            (o.index, o.text, o.token_ids, o.delta_text, o.delta_token_ids, o.finish_reason, o.stop_reason)
            for o in out.outputs
        ]
        + [out.finished]
        for out in outputs
    ]


def test_same_outputs_a_step_later(tiny_model_dir: pathlib.Path) -> None:
    """Without memory pressure the batches match step for step: every output is the plain engine's,
    one step later, and one step (with nothing to schedule) hands back the last ones."""
    requests, continuations = _requests(tiny_model_dir)
    plain_engine = make_engine(tiny_model_dir, settings=OFF)
    plain, num_plain_steps = _run(plain_engine, requests, abort_after=4)
    engine = make_engine(tiny_model_dir, settings=ON)
    assert engine.overlaps_output
    engine.add_request("first", [5, 6, 7], GREEDY.replace(max_tokens=1))
    assert engine.step() == []  # its token is out, its output comes with the next step
    assert engine.has_unfinished_requests()
    (first,) = engine.step()
    assert first.finished and len(first.outputs[0].token_ids) == 1
    assert not engine.has_unfinished_requests()
    overlapped, num_steps = _run(engine, requests, abort_after=4)  # its tokens then are the same
    assert num_steps == num_plain_steps + 1
    for request_id in requests:
        assert _streamed(overlapped[request_id]) == _streamed(plain[request_id]), request_id
        if request_id != ABORTED:  # its last output and the abort's come as one when overlapped
            assert _each_output(overlapped[request_id]) == _each_output(plain[request_id]), request_id
    assert overlapped["stop"][-1].outputs[0].stop_reason == requests["stop"][1].stop[0]
    assert overlapped["stop-included"][-1].outputs[0].text.endswith(requests["stop-included"][1].stop[0])
    assert overlapped["stop-token"][-1].outputs[0].finish_reason == "stop"
    assert len(overlapped["eos"][-1].outputs[0].token_ids) == 5
    aborted = overlapped[ABORTED][-1].outputs[0]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 100
    assert aborted.token_ids == continuations[ABORTED][: len(aborted.token_ids)]


def test_same_outputs_under_preemption(tiny_model_dir: pathlib.Path) -> None:
    requests, continuations = _requests(tiny_model_dir)
    results = {}
    for settings in (OFF, ON):
        engine = make_engine(tiny_model_dir, settings=settings, num_kv_blocks=30, block_size=4)
        outputs, _ = _run(engine, requests, abort_after=6)
        assert engine.scheduler.num_preemptions > 0
        results[settings.overlap_output] = outputs
    for request_id in requests:
        if request_id != ABORTED:
            assert _streamed(results["1"][request_id]) == _streamed(results["0"][request_id]), request_id
    for outputs in results.values():  # aborted wherever it had got to: a prefix of its continuation
        aborted = outputs[ABORTED][-1].outputs[0]
        assert aborted.finish_reason == "abort"
        assert aborted.token_ids == continuations[ABORTED][: len(aborted.token_ids)]
        _streamed(outputs[ABORTED])


def test_stop_strings_inside_accepted_drafts(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation appends several tokens a step; a stop string among them ends the sequence there
    and the tokens after it are dropped, the step after when overlapped. An oracle proposer (the
    true continuation) makes every draft accepted."""
    requests, continuations = _requests(tiny_model_dir)
    requests = {rid: requests[rid] for rid in ("stop", "stop-included")}
    plain, _ = _run(make_engine(tiny_model_dir, settings=OFF), requests)

    def oracle(token_ids: list[int], max_proposals: int, **_: int) -> list[int]:
        for request_id, (prompt, _params) in requests.items():
            full = [*prompt, *continuations[request_id]]  # type: ignore[misc]
            if full[: len(token_ids)] == token_ids:
                return full[len(token_ids) : len(token_ids) + max_proposals]
        return []

    num_dropped: list[int] = []
    detokenize = OutputProcessor.detokenize

    def counting(self: OutputProcessor, seq: object, num_new: int) -> int | None:
        dropped = detokenize(self, seq, num_new)  # type: ignore[arg-type]
        num_dropped.append(dropped or 0)
        return dropped

    monkeypatch.setattr(token_appender.ngram, "propose", oracle)
    monkeypatch.setattr(OutputProcessor, "detokenize", counting)
    for settings in (OFF, ON):
        engine = make_engine(tiny_model_dir, settings=settings, speculative="ngram", num_speculative_tokens=4)
        outputs, _ = _run(engine, requests)
        assert engine.stats().num_spec_accepted_total > 0
        assert engine.stats().num_generation_tokens_total == sum(
            len(o[-1].outputs[0].token_ids) for o in outputs.values()
        )
        for request_id in requests:
            assert _streamed(outputs[request_id]) == _streamed(plain[request_id]), request_id
    assert max(num_dropped) > 0  # the stop strings did fall inside drafts


def test_the_switch(tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny_model_dir)  # auto: on CUDA only (on CPU there is no device to overlap)
    assert engine.overlaps_output is (engine.runner.device.type == "cuda")
    monkeypatch.setenv("CORRAL_OVERLAP_OUTPUT", "1")
    assert EngineSettings().overlap_output == "1"
