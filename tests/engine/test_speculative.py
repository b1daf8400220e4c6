"""N-gram speculative decoding: greedy output is identical with and without it."""

from __future__ import annotations

import pathlib

import pytest
from corral_engine import token_appender
from corral_engine.args import ArgumentError, EngineArgs
from corral_engine.core import ngram
from corral_engine.core.ngram import propose
from corral_engine.sampling_params import SamplingParams

from tests.engine.helpers import make_engine, random_prompts, run_checked


def test_propose_finds_the_latest_recurring_ngram() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]
    assert propose([4, 5, 6], 3) == []
    assert propose([8, 1, 8], 4, min_ngram=1) == [1, 8]
    assert propose([8, 1, 8], 4) == []  # 1-token matches do not propose by default
    assert propose([1, 2, 1, 2], 0) == []


def test_propose_respects_the_ngram_length_bounds() -> None:
    ids = [5, 6, 7, 9, 6, 7]  # the 2-gram (6, 7) recurs, followed by 9
    assert propose(ids, 2, min_ngram=2) == [9, 6]
    assert propose(ids, 2, min_ngram=3) == []  # no 3-gram recurs
    assert propose([4, 1, 2, 3, 4, 8], 2) == []  # 8 never occurred before
    ids = [4, 9, 2, 3, 7, 4]  # 1-gram 4 recurs
    assert propose(ids, 2, min_ngram=1) == [9, 2]
    assert propose(ids, 2) == []
    # longer n-grams first; max_ngram=1 takes the latest earlier occurrence of the last token instead
    ids = [1, 2, 5, 3, 2, 6, 1, 2]
    assert propose(ids, 1) == [5]  # the 2-gram (1, 2) first
    assert propose(ids, 1, min_ngram=1, max_ngram=1) == [6]  # the latest earlier 2


def test_prompt_lookup_bounds_are_validated() -> None:
    with pytest.raises(ArgumentError, match="prompt_lookup_min"):
        EngineArgs(model="m", prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ArgumentError, match="prompt_lookup_min"):
        EngineArgs(model="m", prompt_lookup_min=0)
    defaults = EngineArgs(model="m")
    assert (defaults.prompt_lookup_min, defaults.prompt_lookup_max) == (ngram.MIN_NGRAM, ngram.MAX_NGRAM)
    assert EngineArgs(model="m", prompt_lookup_min=1).to_cli_args() == [
        "--model",
        "m",
        "--prompt-lookup-min",
        "1",
    ]


def _run(
    model_dir: pathlib.Path, prompts: list[list[int]], **kwargs: object
) -> tuple[dict[str, list[int]], object]:
    engine = make_engine(model_dir, block_size=4, **kwargs)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return run_checked(engine), engine.stats()


def test_greedy_output_identical_with_ngram_speculation(tiny_model_dir: pathlib.Path) -> None:
    base = random_prompts(6, 500, seed=11, min_len=5, max_len=12)
    prompts = [p * 4 for p in base]  # repetitive prompts, like summaries or code edits
    plain, _ = _run(tiny_model_dir, prompts)
    spec, stats = _run(tiny_model_dir, prompts, speculative="ngram", num_speculative_tokens=4)
    assert spec == plain
    assert stats.num_spec_proposed_total > 0  # type: ignore[attr-defined]


def test_accepted_drafts_cut_steps_and_rejected_ones_change_nothing(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random-weight model rarely repeats itself, so drive verification with an oracle proposer
    (the true continuation) and an adversarial one (always wrong)."""
    prompts = random_prompts(4, 500, seed=13, min_len=5, max_len=30)
    plain, plain_stats = _run(tiny_model_dir, prompts)
    truth = {tuple(p): p + plain[f"r{i}"] for i, p in enumerate(prompts)}

    def oracle(token_ids: list[int], max_proposals: int, **_: int) -> list[int]:
        for prompt, full in truth.items():
            n = len(token_ids)
            if tuple(token_ids[: len(prompt)]) == prompt and full[:n] == token_ids:
                return full[n : n + max_proposals]
        return []

    monkeypatch.setattr(token_appender.ngram, "propose", oracle)
    spec, stats = _run(tiny_model_dir, prompts, speculative="ngram", num_speculative_tokens=4)
    assert spec == plain
    assert stats.num_spec_accepted_total == stats.num_spec_proposed_total > 0  # type: ignore[attr-defined]
    assert stats.num_steps_total * 3 < plain_stats.num_steps_total  # type: ignore[attr-defined]

    monkeypatch.setattr(token_appender.ngram, "propose", lambda ids, k, **_: [(ids[-1] + 1) % 500] * k)
    spec, stats = _run(tiny_model_dir, prompts, speculative="ngram", num_speculative_tokens=4)
    assert spec == plain


def test_speculation_under_preemption_and_small_budget(tiny_model_dir: pathlib.Path) -> None:
    prompts = [p * 3 for p in random_prompts(8, 500, seed=12, min_len=6, max_len=10)]
    plain, _ = _run(tiny_model_dir, prompts, num_kv_blocks=40)
    spec, stats = _run(
        tiny_model_dir, prompts, num_kv_blocks=40, max_num_batched_tokens=16, speculative="ngram"
    )
    assert spec == plain
    assert stats.num_preemptions_total > 0  # type: ignore[attr-defined]
