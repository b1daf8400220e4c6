"""Engine behaviour through its Python API: policies, sampling, n > 1, stops, errors, leaks."""

from __future__ import annotations

import logging
import pathlib
import re

import numpy
import pytest
from corral_engine import EngineArgs, SamplingParams
from corral_engine.args import ArgumentError
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingError

from tests.engine.helpers import make_engine, random_prompts, run_checked


def test_reserve_never_preempts_and_preempt_completes_everything(tiny_model_dir: pathlib.Path) -> None:
    prompts = random_prompts(12, 500, seed=1, min_len=20, max_len=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for policy in ("reserve", "preempt"):
        engine = make_engine(tiny_model_dir, num_kv_blocks=16, block_size=8, kv_policy=policy)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        results[policy] = run_checked(engine)
        assert len(results[policy]) == len(prompts)
        assert all(len(t) == 24 for t in results[policy].values())
        preemptions = engine.stats().num_preemptions_total
        assert (preemptions == 0) if policy == "reserve" else (preemptions > 0)
    assert results["reserve"] == results["preempt"]


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model_dir: pathlib.Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_engine(tiny_model_dir).generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    engine = make_engine(tiny_model_dir)
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    outs = engine.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [others, params, others])
    assert outs[1].outputs[0].token_ids == alone
    unseeded = make_engine(tiny_model_dir, seed=1).generate([[5, 6, 7]] * 4, others)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_n_greater_than_one_shares_prompt_blocks(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, block_size=4)
    prompt = random_prompts(1, 500, seed=2, min_len=30, max_len=30)[0]
    engine.add_request(
        "n", prompt, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    )
    shared_seen = False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        seqs = engine.live_sequences()
        if len(seqs) == 4 and all(s.block_table for s in seqs):
            first = seqs[0].block_table[0]
            shared_seen |= all(s.block_table[0] == first for s in seqs)
            assert engine.block_manager.blocks[first].ref_count >= 2
        engine.block_manager.check_invariants(seqs)
    assert shared_seen
    final = outputs[-1]
    assert [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in final.outputs)
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_token_ids_eos_and_max_tokens(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = engine.generate([[4, 5, 6]], greedy)[0].outputs[0].token_ids
    out = engine.generate([[4, 5, 6]], greedy.replace(stop_token_ids=(tokens[3],)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[3]
    assert out.token_ids == tokens[: tokens.index(tokens[3]) + 1]
    length = engine.generate([[4, 5, 6]], greedy.replace(max_tokens=3))[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


def test_penalties_and_logprobs(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir)
    base = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = engine.generate([[7, 8]], base)[0].outputs[0]
    penalized = engine.generate([[7, 8]], base.replace(frequency_penalty=2.0, presence_penalty=2.0))[
        0
    ].outputs[0]
    # Greedy with penalties must change what a repetitive random model says (the sampler's
    # arithmetic is pinned in test_sampler.py); each repeated token costs it 2 + 2 per occurrence.
    assert penalized.token_ids != plain.token_ids
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))
    engine.add_request("lp", [7, 8], base)
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs += out.outputs[0].delta_logprobs or []
    assert len(logprobs) == 20
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1]
        assert lp.logprob <= 0.0 and lp.token_id == lp.top[0][0]  # greedy picks the top token


def test_abort_frees_blocks(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir)
    for i in range(4):
        engine.add_request(f"r{i}", [1, 2, 3] * 10, SamplingParams(max_tokens=50, n=2, ignore_eos=True))
    engine.step()
    engine.step()
    for i in range(4):
        out = engine.abort_request(f"r{i}")
        assert out is not None and out.finished
        assert all(o.finish_reason == "abort" for o in out.outputs)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_k": -5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params_raise_clear_errors(kwargs: dict, param: str) -> None:
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "param", "text"),
    [
        ({"max_tokens": 2.5}, "max_tokens", "max_tokens must be int or None, got float 2.5"),
        ({"max_tokens": "8"}, "max_tokens", "must be int or None"),
        ({"temperature": "hot"}, "temperature", "temperature must be float, got str 'hot'"),
        ({"seed": "x"}, "seed", "seed must be int or None"),
        ({"n": True}, "n", "n must be int, got bool"),
        ({"stop_token_ids": 5}, "stop_token_ids", "stop_token_ids must be list of int, got int 5"),
        ({"stop": [1]}, "stop", "stop must be list of str"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias", "logit_bias keys must be token ids, got 'x'"),
        ({"logit_bias": {"²": 1.0}}, "logit_bias", "keys must be token ids"),  # a digit int() refuses
        ({"logit_bias": {5: "high"}}, "logit_bias", "logit_bias must be a dict of token id"),
        ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be bool"),
        ({"output_kind": 3}, "output_kind", "output_kind must be one of"),
    ],
)
def test_sampling_params_of_the_wrong_type_name_the_field(kwargs: dict, param: str, text: str) -> None:
    """Checked at construction, not a bare TypeError from a comparison inside (or, for 2.5 tokens,
    a third token)."""
    with pytest.raises(SamplingError, match=re.escape(text)) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_max_tokens_none_generates_up_to_the_context_or_the_cache(tiny_model_dir: pathlib.Path) -> None:
    # vLLM's meaning of max_tokens=None: as many as the context leaves after the prompt.
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10]
    for num_kv_blocks, expected in [(256, 64 - 6), (5, 5 * 8 - 6)]:  # the context, else the cache
        engine = make_engine(tiny_model_dir, max_model_len=64, block_size=8, num_kv_blocks=num_kv_blocks)
        out = engine.generate([prompt], params)[0].outputs[0]
        assert (len(out.token_ids), out.finish_reason) == (expected, "length")
    assert params.max_tokens is None  # the caller's params are left as given


def test_repeated_token_ids_are_kept_once_and_stop_ids_are_bounded() -> None:
    """A million copies of one id are one id (each copy cost every step of every batch it was in);
    more distinct stop ids than anyone needs are refused, as an oversized logit_bias is."""
    params = SamplingParams(stop_token_ids=[5, 9, 5] * 300_000, allowed_token_ids=[7, 3, 7] * 300_000)
    assert params.stop_token_ids == (5, 9) and params.allowed_token_ids == (7, 3)
    assert len(SamplingParams(stop_token_ids=list(range(1024))).stop_token_ids) == 1024
    with pytest.raises(SamplingError) as info:
        SamplingParams(stop_token_ids=list(range(1025)))
    assert info.value.param == "stop_token_ids"


def test_sampling_params_take_vllm_and_openai_spellings(tiny_model_dir: pathlib.Path) -> None:
    """logit_bias as a dict, keys ints or JSON's digit strings; stop as a string or None; numpy's
    numbers. All become the fields' own types."""
    pairs = SamplingParams(logit_bias=((7, 100.0),))
    assert SamplingParams(logit_bias={7: 100}) == SamplingParams(logit_bias={"7": 100.0}) == pairs
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()
    assert SamplingParams(stop="x").stop == ("x",)
    params = SamplingParams(max_tokens=numpy.int64(3), temperature=numpy.float32(0.5))
    assert type(params.max_tokens) is int and type(params.temperature) is float
    engine = make_engine(tiny_model_dir, max_model_len=64)
    [out] = engine.generate("hello", SamplingParams(max_tokens=3, temperature=0.0, logit_bias={7: 100}))
    assert out.outputs[0].token_ids == [7, 7, 7]


def test_bad_requests_raise_and_leak_nothing(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, max_model_len=64)
    bad = [
        ([1] * 64, SamplingParams(max_tokens=1), "maximum context length"),
        ([1] * 60, SamplingParams(max_tokens=10), "max_tokens"),
        ([], SamplingParams(), "empty"),
        ([10**6], SamplingParams(), "token ids"),
    ]
    for prompt, params, text in bad:
        with pytest.raises(InvalidRequestError, match=text):
            engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=2))
    assert len(run_checked(engine)) == 1


def test_generate_takes_a_string_as_one_prompt_and_queues_nothing_when_one_is_refused(
    tiny_model_dir: pathlib.Path,
) -> None:
    engine = make_engine(tiny_model_dir, max_model_len=64)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    [one] = engine.generate("Hello there", params)  # not one request per character
    assert one.outputs[0].token_ids == engine.generate(["Hello there"], params)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.generate(["fine", [1] * 64], params)
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate(["a", "b"], [params])
    assert not engine.has_unfinished_requests()  # the good prompts were not left queued


def test_bad_engine_args_and_checkpoints(tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path) -> None:
    with pytest.raises(ArgumentError, match="power of two"):
        EngineArgs(model="x", block_size=12)
    with pytest.raises(ArgumentError, match="kv_policy"):
        EngineArgs(model="x", kv_policy="swap")  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineArgs(model=str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match="is a file, not a checkpoint directory"):
        LLMEngine(EngineArgs(model=str(tiny_model_dir / "config.json")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLMEngine(EngineArgs(model=str(tmp_path / "empty")))
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="supported: LlamaForCausalLM"):
        LLMEngine(EngineArgs(model=str(gpt)))
    broken = tmp_path / "noweights"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(EngineArgs(model=str(broken)))


def test_prompt_tokens_count_once_prefilled_not_on_arrival(tiny_model_dir: pathlib.Path) -> None:
    """vllm:prompt_tokens_total is prefill work done: a request waiting behind a full batch, or
    aborted before it started, has not been counted."""
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("first", [1, 2, 3, 4, 5], params)
    engine.add_request("second", [6, 7, 8], params)
    engine.add_request("dropped", [9, 9], params)
    assert engine.stats().num_prompt_tokens_total == 0
    engine.step()  # only "first" runs (one sequence at a time) and gets its first token
    assert engine.stats().num_prompt_tokens_total == 5
    engine.abort_request("dropped")
    run_checked(engine)
    assert engine.stats().num_prompt_tokens_total == 5 + 3


def test_delta_outputs_carry_only_whats_new_until_each_sequence_finishes(
    tiny_model_dir: pathlib.Path,
) -> None:
    """output_kind="delta" (what the server asks for): no whole-text copy per step; the deltas
    add up to the cumulative run's output, and a finished sequence's output is complete."""
    prompt = random_prompts(1, 500, seed=4, min_len=12, max_len=12)[0]
    base = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    runs = {}
    for kind in ("cumulative", "delta"):
        engine = make_engine(tiny_model_dir)
        engine.add_request("r", prompt, base.replace(output_kind=kind))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        runs[kind] = outputs
    final = runs["cumulative"][-1]
    assert final.finished and all(len(o.token_ids) == 12 and o.text for o in final.outputs)
    assert runs["delta"][-1].outputs == final.outputs
    for index, whole in enumerate(final.outputs):
        seen = [o for out in runs["delta"] for o in out.outputs if o.index == index]
        running = [o for o in seen if o.finish_reason is None]
        assert running and all(o.text == "" and o.token_ids == [] for o in running)
        assert [t for o in seen for t in o.delta_token_ids] == whole.token_ids
        assert "".join(o.delta_text for o in seen) == whole.text
    with pytest.raises(SamplingError):
        SamplingParams(output_kind="final")  # type: ignore[arg-type]


def test_a_cache_or_context_the_model_cannot_have_is_warned_about(
    tiny_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=2, max_model_len=100_000)
    with caplog.at_level(logging.WARNING, logger="corral_engine.llm_engine"):
        engine = LLMEngine(args)
    assert engine.max_model_len == 512
    text = caplog.text
    assert "--max-model-len 100000 is past the model's 512 positions" in text
    assert "the KV cache holds 32 tokens, fewer than max_model_len 512" in text


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_siblings_under_a_cache_for_one_sequence_finish_with_a_roomy_engines_output(
    tiny_model_dir: pathlib.Path, prefix_caching: bool
) -> None:
    """Forked siblings wait holding their parent's prompt blocks: once the parent was preempted,
    they kept the only sequence that could run from ever getting blocks (served, three requests
    hung for good with nothing running)."""
    shapes = [(24, 14, 3), (9, 11, 1), (12, 23, 3), (41, 1, 3), (35, 7, 1), (1, 16, 3)]  # prompt, max, n
    prompts = random_prompts(len(shapes), 1000, seed=5, min_len=41, max_len=41)
    requests = [
        (prompt[:length], SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True))
        for prompt, (length, max_tokens, n) in zip(prompts, shapes, strict=True)
    ]
    finals = []
    for kwargs in ({}, {"num_kv_blocks": 12, "max_num_batched_tokens": 8}):  # 48 tokens of KV
        engine = make_engine(tiny_model_dir, block_size=4, enable_prefix_caching=prefix_caching, **kwargs)
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
        final = {}
        for _ in range(2_000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = [o.token_ids for o in out.outputs]
        assert not engine.has_unfinished_requests()
        finals.append(final)
    assert finals[1] == finals[0]
