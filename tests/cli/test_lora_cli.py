"""The CLI's LoRA surface: `corral demo-model DIR --lora-adapter OUT` writes a PEFT adapter whose
B is not zero, and `corral engine`'s list flag --lora-modules reads back as EngineArgs renders it."""

from __future__ import annotations

import argparse
import json
import pathlib

from corral_cli import cmd_engine, main
from safetensors.torch import load_file


def test_demo_model_writes_a_peft_adapter(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "adapter"
    code = main.main(
        ["demo-model", str(tiny_model_dir), "--lora-adapter", str(out), "--lora-rank", "4", "--quiet"]
    )
    assert code == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA" and "q_proj" in config["target_modules"]
    tensors = load_file(out / "adapter_model.safetensors")
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert b.shape[1] == 4 and b.abs().sum() > 0  # PEFT's fresh B is zero; this one changes outputs
    assert (
        main.main(["demo-model", str(tmp_path / "none"), "--lora-adapter", str(tmp_path / "x"), "--quiet"])
        == 1
    )


def test_lora_flags_read_back_as_engine_args_render_them() -> None:
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    flags = ["--model", "/m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    flags += ["--max-lora-rank", "32"]
    args = cmd_engine.engine_args_from(parser.parse_args(flags))
    assert args.lora_modules == ("a=/x", '{"name": "b", "path": "/y"}') and args.max_lora_rank == 32
    assert args.to_cli_args() == flags
