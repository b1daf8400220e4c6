"""A simulated replica refuses what the real engine refuses: it runs the engine's request checks
(`corral_engine.request_checks`), so a client gets the same 400 from either."""

from __future__ import annotations

import pathlib

import pytest
from corral_engine.errors import InvalidRequestError
from corral_engine.sampling_params import SamplingParams
from corral_engine.sim.engine import SimEngine
from corral_engine.sim.perf_model import Fitted, Profile
from corral_engine.sim.tokenizer import LightTokenizer

PROFILE = Profile("test", Fitted((0.02, 0.0, 1e-4, 0.0, 0.0)), num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ("hello", SamplingParams(logit_bias=((99_999, 5.0),)), "logit_bias"),
        ("hello", SamplingParams(allowed_token_ids=(99_999,)), "allowed_token_ids"),
        ([5, 99_999], SamplingParams(), "prompt"),
        ([5] * 256, SamplingParams(max_tokens=1), "prompt"),
        ("hello", SamplingParams(max_tokens=300), "max_tokens"),
    ],
)
def test_the_engine_checks_refuse_a_request(
    tiny_model_dir: pathlib.Path, prompt: str | list[int], params: SamplingParams, param: str
) -> None:
    engine = SimEngine(PROFILE, LightTokenizer(tiny_model_dir), "sim")
    with pytest.raises(InvalidRequestError) as raised:
        engine.make_request("r", prompt, params)
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("prompt", "params"),
    [([5] * 256, SamplingParams(max_tokens=1)), ("hello", SamplingParams(max_tokens=300))],
)
def test_both_context_length_errors_read_as_openai_words_them(
    tiny_model_dir: pathlib.Path, prompt: str | list[int], params: SamplingParams
) -> None:
    engine = SimEngine(PROFILE, LightTokenizer(tiny_model_dir), "sim")
    with pytest.raises(InvalidRequestError, match=r"^This model's maximum context length is 256 tokens; "):
        engine.make_request("r", prompt, params)


@pytest.mark.parametrize("arch", ["granite", "olmo2", "gemma2"])
def test_the_newer_text_architectures_are_simulated(arch: str, tmp_path: pathlib.Path) -> None:
    """What `--simulate` reads of a Granite, OLMo 2 or Gemma 2 checkpoint (config.json and the
    tokenizer, no weights): a generating replica that takes a request."""
    from corral_engine.demo_model import write_demo_model
    from corral_engine.sim.embedding import sim_pooling
    from corral_engine.sim.host import checkpoint_quantization, eos_token_ids

    model_dir = write_demo_model(tmp_path / arch, arch=arch, weights=False)
    tokenizer = LightTokenizer(model_dir)
    assert sim_pooling(model_dir, "auto", None, "sim") is None
    assert checkpoint_quantization(model_dir) is None and eos_token_ids(model_dir, tokenizer) == (2,)
    SimEngine(PROFILE, tokenizer, "sim").make_request("r", "hello", SamplingParams(max_tokens=4))
