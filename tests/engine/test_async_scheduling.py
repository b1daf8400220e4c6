"""Async scheduling (CORRAL_ASYNC_SCHEDULING): a step is scheduled and launched before the last
step's tokens reach the host; those sequences hold a placeholder, and the step's inputs take the
sampled ids on the device. The outputs must be the plain engine's, token for token and text for
text, whatever the requests ask for (the steps that cannot run ahead wait as before), with blocks
and prefix-cache entries accounted for after every step."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from corral_engine.model import batch as batch_module
from corral_engine.model.batch import PENDING_TOKEN, TokenFill
from corral_engine.model.cuda_graphs import EagerCapture
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

from tests.engine.helpers import make_engine, random_prompts
from tests.engine.test_output_overlap import ABORTED, GREEDY, Requests, _requests, _run, _streamed

SYNC = EngineSettings(async_scheduling="0", overlap_output="0")
AHEAD = EngineSettings(async_scheduling="1", overlap_output="0")
AHEAD_OVERLAPPED = EngineSettings(async_scheduling="1", overlap_output="1")


@pytest.fixture
def fills(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many pending tokens each step's inputs took on the device."""
    counts: list[int] = []
    targets = TokenFill.targets

    def counting(self: TokenFill, scheduled: list) -> tuple[list[int], list[int]]:  # type: ignore[type-arg]
        dst, src = targets(self, scheduled)
        counts.append(len(dst))
        return dst, src

    monkeypatch.setattr(batch_module.TokenFill, "targets", counting)
    yield counts


@pytest.mark.parametrize("settings", [AHEAD, AHEAD_OVERLAPPED], ids=["ahead", "ahead+overlap"])
def test_same_outputs_as_the_plain_engine(
    tiny_model_dir: pathlib.Path, settings: EngineSettings, fills: list[int]
) -> None:
    """Stop strings, stop tokens, EOS (a step computed for nothing after it), max_tokens,
    logprobs, n > 1 with seeds, prompt logprobs, a JSON schema, an abort and plain requests in one
    batch: the ones that allow it run ahead, the others make their steps wait."""
    requests, continuations = _requests(tiny_model_dir)
    plain, _ = _run(make_engine(tiny_model_dir, settings=SYNC), requests, abort_after=4)
    engine = make_engine(tiny_model_dir, settings=settings)
    assert engine.schedules_ahead
    outputs, _ = _run(engine, requests, abort_after=4)
    assert sum(fills) > 0, "no step ran ahead"
    for request_id in requests:
        if request_id != ABORTED:
            assert _streamed(outputs[request_id]) == _streamed(plain[request_id]), request_id
    aborted = outputs[ABORTED][-1].outputs[0]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 100
    assert aborted.token_ids == continuations[ABORTED][: len(aborted.token_ids)]
    assert PENDING_TOKEN not in aborted.token_ids
    assert len(outputs["eos"][-1].outputs[0].token_ids) == 5


def test_same_outputs_under_preemption(tiny_model_dir: pathlib.Path, fills: list[int]) -> None:
    """A small cache preempts sequences whose newest token is still pending; they come back with
    it in place (their recompute never reads a placeholder)."""
    prompts = random_prompts(8, 500, seed=41, min_len=5, max_len=30)
    params = [GREEDY.replace(max_tokens=20 + i) for i in range(len(prompts))]
    results = []
    for settings in (SYNC, AHEAD):
        engine = make_engine(tiny_model_dir, settings=settings, num_kv_blocks=30, block_size=4)
        requests: Requests = {f"r{i}": (prompt, params[i]) for i, prompt in enumerate(prompts)}
        outputs, _ = _run(engine, requests)
        assert engine.scheduler.num_preemptions > 0
        results.append({rid: _streamed(outs) for rid, outs in outputs.items()})
    assert results[0] == results[1]
    assert sum(fills) > 0


def test_prefix_cache_entries_hold_the_real_tokens(tiny_model_dir: pathlib.Path) -> None:
    """A block completed by a pending token joins the prefix cache once the token is known: a
    second turn (the first turn's prompt and reply, then more) hits the same blocks and gets the
    same reply as without running ahead."""
    first = random_prompts(1, 500, seed=51, min_len=13, max_len=13)[0]
    results = []
    for settings in (SYNC, AHEAD):
        engine = make_engine(tiny_model_dir, settings=settings, block_size=4)
        (reply,) = engine.generate([first], GREEDY.replace(max_tokens=17))
        second = [*first, *reply.outputs[0].token_ids, 7, 8, 9]
        (answer,) = engine.generate([second], GREEDY.replace(max_tokens=9))
        hits = engine.stats().num_prefix_cache_hits_total
        results.append((reply.outputs[0].token_ids, answer.outputs[0].token_ids, hits))
    assert results[0] == results[1]
    assert results[1][2] >= 28  # the first turn's 30 tokens: 7 full blocks of 4


def test_decode_graphs_take_pending_tokens_on_the_device(
    tiny_model_dir: pathlib.Path, fills: list[int]
) -> None:
    """The GPU path on CPU: the triton backend (interpreted) and captured decode graphs replayed
    over their persistent buffers, where a pending id is gathered into the input ids after the
    inputs' copy; padded batches as requests finish at different lengths."""
    prompts = random_prompts(5, 500, seed=61, min_len=2, max_len=20)
    params = [GREEDY.replace(max_tokens=6 + 2 * i) for i in range(len(prompts))]
    results = []
    for async_scheduling in ("0", "1"):
        settings = EngineSettings(triton_interpret=True, async_scheduling=async_scheduling)
        capture = EagerCapture()
        engine = make_engine(
            tiny_model_dir, settings, graph_capture=capture, attention_backend="triton", max_num_seqs=4
        )
        outputs = engine.generate(prompts, params)
        results.append([o.outputs[0].token_ids for o in outputs])
        assert capture.replayed
    assert results[0] == results[1]
    assert sum(fills) > 0


def test_the_switch(tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineSettings().async_scheduling == "auto"  # on CUDA, measured on an H200
    default = make_engine(tiny_model_dir)
    assert default.schedules_ahead is (default.runner.device.type == "cuda")
    assert make_engine(tiny_model_dir, settings=AHEAD).schedules_ahead
    assert not make_engine(tiny_model_dir, settings=SYNC).schedules_ahead
    speculating = make_engine(tiny_model_dir, settings=AHEAD, speculative="ngram")
    assert not speculating.schedules_ahead  # drafts come from the newest token
    monkeypatch.setenv("CORRAL_ASYNC_SCHEDULING", "1")
    assert EngineSettings().async_scheduling == "1"


def test_sampling_that_reads_the_last_token_waits(tiny_model_dir: pathlib.Path, fills: list[int]) -> None:
    """Penalties and seeds run ahead (they read the tokens after the wait); a request that ends by
    length with its next token makes that step wait, so no step is computed past max_tokens."""
    prompts = random_prompts(3, 500, seed=71, min_len=4, max_len=12)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, repetition_penalty=1.3, ignore_eos=True)
    results = []
    for settings in (SYNC, AHEAD):
        engine = make_engine(tiny_model_dir, settings=settings)
        outputs = engine.generate(prompts, params)
        results.append(([o.outputs[0].token_ids for o in outputs], engine.stats().num_steps_total))
    assert results[0] == results[1]
    assert sum(fills) > 0
