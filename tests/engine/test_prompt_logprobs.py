"""prompt_logprobs: every prompt token's logprob given the ones before it, as transformers computes
them, however the prompt is chunked, preempted or cached."""

from __future__ import annotations

import pathlib

import pytest
import torch
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

from bench.gpu import reference
from tests.engine.helpers import make_engine, random_prompts


def _final(engine, request_id: str):  # type: ignore[no-untyped-def]
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def test_prompt_logprobs_match_transformers_in_any_chunking(tiny_model_dir: pathlib.Path) -> None:
    (prompt,) = random_prompts(1, 40, seed=5)
    model = reference.load_model(tiny_model_dir, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, n=2, seed=1)
    for chunk in (512, 7):  # whole, then in chunks of 7 tokens (chunked prefill)
        engine = make_engine(tiny_model_dir, max_num_batched_tokens=chunk, enable_prefix_caching=True)
        for request_id in ("a", "b"):  # "b" shares the whole prompt: no prefix-cache shortcut
            engine.add_request(request_id, prompt, params)
            out = _final(engine, request_id)
            scored = out.prompt_logprobs
            assert scored is not None and len(scored) == len(prompt) and scored[0] is None
            for q, item in enumerate(scored[1:], start=1):
                assert item is not None and item.token_id == prompt[q]
                assert abs(item.logprob - float(ref[q - 1, prompt[q]])) < 1e-4
                assert [t for t, _ in item.top] == torch.topk(ref[q - 1], 3).indices.tolist()
                assert item.rank == int((ref[q - 1] > ref[q - 1, prompt[q]]).sum()) + 1


def test_prompt_logprobs_survive_preemption(tiny_model_dir: pathlib.Path) -> None:
    prompts = random_prompts(6, 30, seed=9)
    engine = make_engine(tiny_model_dir, num_kv_blocks=12, block_size=16)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, ignore_eos=True, prompt_logprobs=0))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        scored = finals[f"r{i}"].prompt_logprobs
        assert [x.token_id if x else None for x in scored] == [None, *prompt[1:]]


def test_prompt_logprobs_on_the_triton_backend(tiny_model_dir: pathlib.Path) -> None:
    """The unified (triton) batch puts the prompt rows after the sampling rows too."""
    (prompt,) = random_prompts(1, 24, seed=6)
    params = SamplingParams(max_tokens=2, prompt_logprobs=0)
    results = []
    for settings, backend in ((None, "auto"), (EngineSettings(triton_interpret=True), "triton")):
        engine = make_engine(tiny_model_dir, settings, attention_backend=backend, max_num_batched_tokens=7)
        engine.add_request("t", prompt, params)
        engine.add_request("other", prompt[:5], SamplingParams(max_tokens=6))  # a sampling row alongside
        results.append([x.logprob for x in _final(engine, "t").prompt_logprobs[1:]])
    assert results[0] == pytest.approx(results[1], abs=1e-4)
