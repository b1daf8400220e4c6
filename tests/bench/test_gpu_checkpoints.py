"""The GPU run's checkpoints: the llama3-8b preset's shape, and checkpoints written shard by shard
(the same tensors as one file, loadable by transformers and the engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from corral_cli.main import build_parser
from corral_engine.demo_model import (
    PRESETS,
    build_config_dict,
    count_parameters,
    plan_shards,
    shard_file_names,
    write_demo_model,
)
from safetensors.torch import load_file


def test_llama3_8b_preset_has_llama_3_8bs_shape() -> None:
    cfg = build_config_dict("llama3-8b", "llama")
    shape = {
        k: cfg[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "rope_theta",
            "rms_norm_eps",
            "dtype",
        )
    }
    assert shape == {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "dtype": "bfloat16",
    }
    assert not cfg["tie_word_embeddings"]
    assert count_parameters(cfg) == 8_030_261_248  # Llama-3-8B's published count


def test_the_cli_offers_the_preset_and_a_device() -> None:
    args = build_parser("demo-model").parse_args(
        ["demo-model", "d", "--preset", "llama3-8b", "--device", "cuda"]
    )
    assert (args.preset, args.device) == ("llama3-8b", "cuda")
    assert set(PRESETS) == {"tiny", "small", "llama3-8b"}


def test_shards_are_consecutive_and_bounded() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 9), ("d", 1), ("e", 3)]
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards(sizes, None) == [["a", "b", "c", "d", "e"]]
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(3)[2] == "model-00003-of-00003.safetensors"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_sharded_checkpoint_holds_the_same_tensors(tmp_path: Path, tiny_model_dirs, arch: str) -> None:
    sharded = write_demo_model(tmp_path / "sharded", preset="tiny", arch=arch, max_shard_bytes=100_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert not (sharded / "model.safetensors").exists()
    whole = load_file(tiny_model_dirs[arch] / "model.safetensors")
    parts = {k: v for f in files for k, v in load_file(sharded / f).items()}
    assert parts.keys() == whole.keys() == index["weight_map"].keys()
    assert all(torch.equal(parts[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())


def test_transformers_and_the_engine_load_a_sharded_checkpoint(tmp_path: Path) -> None:
    from corral_engine import EngineArgs, SamplingParams
    from corral_engine.llm_engine import LLMEngine
    from transformers import AutoModelForCausalLM

    path = write_demo_model(tmp_path / "m", preset="tiny", max_shard_bytes=100_000)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(build_config_dict("tiny"))
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", num_kv_blocks=16, num_threads=1))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
