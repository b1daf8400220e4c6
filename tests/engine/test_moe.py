"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE): the experts' math against transformers' own
in bf16, every on-disk layout a checkpoint can have, Qwen3-MoE's dense layers, bad configs refused,
and the features that do not apply to experts switched off. Greedy equality with transformers in
float32 (alone, batched, chunked, preempted): test_engine_matches_transformers.py."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from corral_engine.demo_model import write_demo_model
from corral_engine.errors import ModelLoadError
from corral_engine.model.config import load_model_config
from corral_engine.model.cuda_graphs import EagerCapture
from corral_engine.model.decode_stack import unsupported
from corral_engine.model.moe import SparseMoeBlock
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from safetensors import safe_open
from safetensors.torch import save_file

from tests.engine.helpers import make_engine, random_prompts, run_checked, transformers_greedy

MOE_ARCHS = ["mixtral", "qwen3-moe"]
MAX_NEW = 10


def _greedy(model_dir: pathlib.Path, prompts: list[list[int]], **engine_kwargs: Any) -> list[list[int]]:
    engine = make_engine(model_dir, **engine_kwargs)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        final = run_checked(engine)
    finally:
        engine.close()  # a tensor-parallel engine's worker processes
    return [final[f"r{i}"] for i in range(len(prompts))]


def _copy_with_config(src: pathlib.Path, dst: pathlib.Path, **changes: Any) -> pathlib.Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bf16_experts_equal_transformers_bit_for_bit(
    arch: str, tiny_model_dirs: Mapping[str, pathlib.Path]
) -> None:
    """Same routing, same per-expert matmuls in the same order, the weights' dtype as each model
    has it (float32 for Mixtral, bf16 for Qwen3-MoE): the block's bf16 output is transformers'."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[arch]
    reference = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, experts_implementation="eager"
    ).eval()
    engine = make_engine(model_dir, dtype="bfloat16")
    x = torch.randn(37, engine.runner.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    with torch.inference_mode():
        for ours, theirs in zip(engine.runner.model.model.layers, reference.model.layers, strict=True):
            assert isinstance(ours.mlp, SparseMoeBlock)
            want = theirs.mlp(x.unsqueeze(0))[0]
            got = ours.mlp(x)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, want)


def test_transformers_v5_fused_expert_layout_loads_the_same(
    tiny_model_dirs: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """A checkpoint written from transformers v5's in-memory state (experts fused, [E, 2I, H])
    loads into the same model as the hub's expert-by-expert layout the demo writes, on one rank
    or split over two."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_dirs["mixtral"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in set(f.keys())
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    state = AutoModelForCausalLM.from_pretrained(str(src)).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))
    prompts = random_prompts(3, 500, seed=11)
    expected = _greedy(src, prompts)
    assert _greedy(fused, prompts) == expected
    # Two ranks each read their gate rows and up rows of the fused tensor and their down columns.
    assert _greedy(fused, prompts, tensor_parallel_size=2) == expected


@pytest.mark.parametrize(
    ("overrides", "num_sparse"),
    [({"mlp_only_layers": [0]}, 1), ({"decoder_sparse_step": 2}, 1), ({"mlp_only_layers": [0, 1]}, 0)],
    ids=["mlp-only-layer", "sparse-step", "all-dense"],
)
def test_qwen3_moe_dense_layers_are_honoured(
    tmp_path: pathlib.Path, overrides: dict[str, Any], num_sparse: int
) -> None:
    model_dir = write_demo_model(tmp_path / "m", preset="tiny", arch="qwen3-moe", config_overrides=overrides)
    prompts = random_prompts(4, 500, seed=12)
    engine = make_engine(model_dir)
    layers = engine.runner.model.model.layers
    assert sum(isinstance(layer.mlp, SparseMoeBlock) for layer in layers) == num_sparse
    assert _greedy(model_dir, prompts) == transformers_greedy(model_dir, prompts, MAX_NEW)


def test_unnormalised_top_k_matches_transformers(tmp_path: pathlib.Path) -> None:
    """Qwen3-MoE's norm_topk_prob false (transformers' default): the top-k weights as softmax left them."""
    overrides = {"norm_topk_prob": False}
    model_dir = write_demo_model(tmp_path / "m", preset="tiny", arch="qwen3-moe", config_overrides=overrides)
    assert load_model_config(model_dir).moe is not None
    assert not load_model_config(model_dir).moe.norm_topk_prob  # type: ignore[union-attr]
    prompts = random_prompts(4, 500, seed=13)
    assert _greedy(model_dir, prompts) == transformers_greedy(model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts"),
        ("mixtral", {"num_local_experts": 0}, "the number of experts"),
        ("qwen3-moe", {"moe_intermediate_size": 0}, "the experts' intermediate size"),
        ("qwen3-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen3-moe", {"mlp_only_layers": "0"}, "field 'mlp_only_layers'"),  # transformers' type check
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("mixtral", {"num_local_experts": 3}, "names expert 3; the config has 3 experts"),
        ("qwen3-moe", {"num_local_experts": 5}, "has shape (4, 64), the config implies (5, 64)"),
    ],
)
def test_a_bad_moe_config_is_a_model_load_error(
    tiny_model_dirs: Mapping[str, pathlib.Path],
    tmp_path: pathlib.Path,
    arch: str,
    changes: dict,
    message: str,
) -> None:
    model_dir = _copy_with_config(tiny_model_dirs[arch], tmp_path / "bad", **changes)
    with pytest.raises(ModelLoadError) as info:
        make_engine(model_dir)
    assert message in str(info.value)


def test_a_missing_expert_tensor_is_named(
    tiny_model_dirs: Mapping[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    model_dir = _copy_with_config(tiny_model_dirs["qwen3-moe"], tmp_path / "m")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        dropped = "model.layers.1.mlp.experts.2.up_proj.weight"
        state = {k: f.get_tensor(k) for k in f.keys() if k != dropped}  # noqa: SIM118
    save_file(state, str(model_dir / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.gate_up_proj:2:up$"
    ):
        make_engine(model_dir)


def test_the_native_decode_stack_does_not_take_experts(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    engine = make_engine(
        tiny_model_dirs["qwen3-moe"], EngineSettings(small_batch_kernel="1"), dtype="bfloat16"
    )
    runner = engine.runner
    assert unsupported(runner.model, runner.kv_caches) == "mixture-of-experts layers"
    assert runner.model.decode_stack is None
    assert _greedy(tiny_model_dirs["qwen3-moe"], [[5, 6, 7]], dtype="bfloat16")  # and it still runs


def test_no_decode_graphs_for_experts(tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    """Routing's per-expert row counts are read on the host: a graph could not record them."""
    model_dir = tiny_model_dirs["mixtral"]
    capture = EagerCapture()
    settings = EngineSettings(triton_interpret=True)
    engine = make_engine(
        model_dir, settings, graph_capture=capture, attention_backend="triton", max_num_seqs=2
    )
    assert engine.runner.graphs is None and capture.captured == []
    prompts = random_prompts(2, 500, seed=14, max_len=12)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    final = run_checked(engine)
    assert [final[f"r{i}"] for i in range(2)] == transformers_greedy(model_dir, prompts, 4)
