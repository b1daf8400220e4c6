"""Phi-3 and Gemma 3 beyond the demo checkpoints (whose plain equality with transformers is in
test_engine_matches_transformers.py): LongRoPE with partial rotary, its factor set picked by the
engine's context as vLLM does; Gemma 3's linearly scaled global rotary; a
Gemma3ForConditionalGeneration checkpoint served as its text model (both hub tensor layouts, one
and two ranks); --quantization int8 on both; an FP8 Phi-3 on two ranks."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
from collections.abc import Mapping

import pytest
import torch
from corral_engine.demo_model import write_demo_model
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams
from safetensors import safe_open
from safetensors.torch import save_file

from tests.engine.helpers import make_engine, random_prompts, run_checked, transformers_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# Phi-4-mini's shape of rotary in the tiny Phi-3 (head_dim 16): 12 of 16 dims rotate, so each
# factor list has 6 entries; trained at 64 positions, stretched to 512.
LONGROPE = {
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 64,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(6)],
        "long_factor": [1.0 + 0.9 * i for i in range(6)],
    },
}


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    final = run_checked(engine)
    engine.runner.close()
    return [final[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_model(
        tmp_path_factory.mktemp("phi3") / "longrope", arch="phi3", config_overrides=LONGROPE
    )


def test_longrope_short_factors_within_the_trained_context(longrope_dir: pathlib.Path) -> None:
    """--max-model-len 64 (the trained length): the short factors, as transformers uses for
    sequences that never pass 64 tokens."""
    prompts = random_prompts(6, 500, seed=41, min_len=20, max_len=64 - MAX_NEW)
    expected = transformers_greedy(longrope_dir, prompts, MAX_NEW)
    assert _generate(make_engine(longrope_dir, max_model_len=64), prompts) == expected


def test_longrope_long_factors_past_it(longrope_dir: pathlib.Path) -> None:
    """The checkpoint's 512 positions: the long factors for every position (transformers switches
    to them once a sequence passes 64 tokens, so prompts start past it), chunked or not."""
    prompts = random_prompts(6, 500, seed=42, min_len=65, max_len=100)
    expected = transformers_greedy(longrope_dir, prompts, MAX_NEW)
    assert _generate(make_engine(longrope_dir), prompts) == expected
    assert _generate(make_engine(longrope_dir, max_num_batched_tokens=16, block_size=8), prompts) == expected


def test_gemma3_global_layers_take_linear_rope_scaling(tmp_path: pathlib.Path) -> None:
    """Gemma 3 4B and larger scale the global layers' rotary by 8 (linear); the local ones keep
    rope_local_base_freq unscaled."""
    overrides = {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    model_dir = write_demo_model(tmp_path / "m", arch="gemma3", config_overrides=overrides)
    prompts = random_prompts(6, 500, seed=43, min_len=20, max_len=90)
    expected = transformers_greedy(model_dir, prompts, MAX_NEW)
    assert _generate(make_engine(model_dir, max_num_batched_tokens=24), prompts) == expected


def _multimodal_checkpoint(text_dir: pathlib.Path, out: pathlib.Path, hub_v4_names: bool) -> pathlib.Path:
    """`text_dir`'s Gemma 3 text model inside a Gemma3ForConditionalGeneration checkpoint with a
    tiny random SigLIP tower: tensors as transformers v5 saves them (model.language_model.*,
    model.vision_tower.*), or as the hub's Gemma 3 files hold them (language_model.model.*,
    vision_tower.vision_model.*)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    text = json.loads((text_dir / "config.json").read_text())
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Gemma3ForConditionalGeneration(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=gen) for n, s in shapes.items() if ".language_model." not in n}
    with safe_open(str(text_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
            state["model.language_model." + name.removeprefix("model.")] = f.get_tensor(name)
    if hub_v4_names:
        renames = {
            "model.language_model.": "language_model.model.",
            "model.vision_tower.": "vision_tower.vision_model.",
            "model.multi_modal_projector.": "multi_modal_projector.",
        }
        state = {
            next((new + n.removeprefix(old) for old, new in renames.items() if n.startswith(old)), n): t
            for n, t in state.items()
        }
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text_dir / name, out / name)
    raw = {**config.to_dict(), "architectures": ["Gemma3ForConditionalGeneration"]}
    (out / "config.json").write_text(json.dumps(raw))
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("hub_v4_names", [False, True], ids=["transformers-v5-names", "hub-v4-names"])
def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(
    tiny_model_dirs: Mapping[str, pathlib.Path],
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
    hub_v4_names: bool,
) -> None:
    """The text model's tensors found under either prefix, the vision tower skipped with one log
    line; greedy equal to transformers' on the text model alone, on one rank and on two."""
    text_dir = tiny_model_dirs["gemma3"]
    model_dir = _multimodal_checkpoint(text_dir, tmp_path / "mm", hub_v4_names)
    prompts = random_prompts(6, 500, seed=44)
    expected = transformers_greedy(text_dir, prompts, MAX_NEW)
    with caplog.at_level(logging.INFO, logger="corral_engine.model.loader"):
        assert _generate(make_engine(model_dir), prompts) == expected
    assert "serving the text model only; 34 vision tower and projector tensors not loaded" in caplog.text
    if hub_v4_names:
        assert _generate(make_engine(model_dir, tensor_parallel_size=2), prompts) == expected


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_int8_quantization_loads_and_is_deterministic(
    arch: str, tiny_model_dirs: Mapping[str, pathlib.Path]
) -> None:
    """--quantization int8 takes every attention and MLP projection (Phi-3's fused checkpoint
    tensors quantized whole, row by row); the same tokens again, and with chunked prompts."""
    prompts = random_prompts(6, 500, seed=45)
    engine = make_engine(tiny_model_dirs[arch], quantization="int8")
    layers = [
        lin
        for layer in engine.runner.model.model.layers
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    assert all(lin.quant == "int8" and lin.weight.dtype == torch.int8 for lin in layers)
    first = _generate(engine, prompts)
    assert _generate(make_engine(tiny_model_dirs[arch], quantization="int8"), prompts) == first
    chunked = make_engine(tiny_model_dirs[arch], quantization="int8", max_num_batched_tokens=7)
    assert _generate(chunked, prompts) == first


def test_an_fp8_phi3_checkpoint_on_two_ranks(tmp_path: pathlib.Path) -> None:
    """An FP8 checkpoint's fused qkv_proj / gate_up_proj: each rank dequantizes its rows of each
    part by the scales of the rows they came from."""
    model_dir = write_demo_model(tmp_path / "fp8", arch="phi3", quantization="fp8")
    prompts = random_prompts(6, 500, seed=46)
    expected = transformers_greedy(model_dir, prompts, MAX_NEW)
    assert _generate(make_engine(model_dir, tensor_parallel_size=2), prompts) == expected
