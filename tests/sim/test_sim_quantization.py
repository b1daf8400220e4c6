"""A simulated replica with quantized weights (`--quantization fp8|int8`, or an FP8 or int4
checkpoint's quantization_config): the projections at 1 byte a parameter (int4: ~0.53) make decode
steps shorter and leave
more memory to the KV cache; fp8 on FP8 tensor cores also halves the projections' FLOP time. Without
quantization every figure is what it was."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil

import pytest
from corral_cli import cmd_engine, simulate
from corral_cli.simulate import replica_spec
from corral_engine.args import EngineArgs
from corral_engine.errors import ModelLoadError
from corral_engine.sampling_params import SamplingParams
from corral_engine.sim.engine import NullTokenizer, SimEngine
from corral_engine.sim.host import checkpoint_quantization, with_overrides
from corral_engine.sim.lora_cost import lora_cost
from corral_engine.sim.perf_model import (
    A100,
    BUILTIN,
    H100,
    LLAMA3_8B,
    Profile,
    Roofline,
    StepShape,
    quantized,
)

DECODE_1 = StepShape(1, 1, 1000, 1000.0)
DECODE_64 = StepShape(64, 64, 64 * 1000, 64 * 1000.0)
PREFILL = StepShape(4096, 1, 4096, 4096 * 2048.5)
FP8_BLOCK = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
FP8_COMPRESSED = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8}}},
    "ignore": ["lm_head"],
}


def _pack_quantized(bits: int) -> dict[str, object]:
    """compressed-tensors W4A16 / W8A16 (llm-compressor's pack-quantized) with `bits`-bit weights."""
    weights = {"type": "int", "num_bits": bits, "strategy": "group", "group_size": 128}
    return {**FP8_COMPRESSED, "format": "pack-quantized", "config_groups": {"g": {"weights": weights}}}


def _engine_args(argv: list[str]) -> tuple[argparse.Namespace, EngineArgs]:
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    args = parser.parse_args(argv)
    return args, cmd_engine.engine_args_from(args)


def _checkpoint(tmp_path: pathlib.Path, tiny: pathlib.Path, quantization_config: object) -> pathlib.Path:
    """The tiny model's tokenizer with a config.json carrying `quantization_config`."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out


def test_without_quantization_the_builtin_figures_are_unchanged() -> None:
    # The figures every fleet_sim result was taken with: bf16 weights, 2 bytes a parameter.
    assert LLAMA3_8B.weight_bytes == 2 * 8.03e9
    assert {name: BUILTIN[name].num_kv_blocks for name in BUILTIN} == {
        "h100-llama3-8b": 25650,
        "h100-llama3-70b": 26361,
        "a100-llama3-8b": 25650,
        "a100-llama3-70b": 26361,
        "h100-llama3-8b-corral": 26855,
        "h100-bge-large": 43985,
    }
    r = Roofline(H100, LLAMA3_8B)
    flops = 2 * 8.03e9 * 4096 + 4 * 32 * 32 * 128 * PREFILL.num_attn_pairs
    assert r.step_time_s(PREFILL) == pytest.approx(1e-3 + 10e-6 + flops / (989e12 * 0.6), rel=1e-12)
    assert with_overrides(BUILTIN["h100-llama3-8b"], {"quantization": None}) == BUILTIN["h100-llama3-8b"]


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("name", ["h100-llama3-8b", "a100-llama3-8b", "h100-llama3-70b"])
def test_quantized_weights_mean_more_kv_blocks_and_shorter_decode_steps(name: str, method: str) -> None:
    base = BUILTIN[name]
    quant = quantized(base, method)
    if method == "fp8" and name.startswith("a100"):  # the engine dequantizes fp8 below sm 8.9
        assert quant == base
        return
    assert isinstance(base.model, Roofline) and isinstance(quant.model, Roofline)
    # The projections at 1 byte, embeddings and lm_head still at 2; the KV cache stays bf16.
    model = quant.model.model
    assert model.weight_bytes == model.num_projection_params + 2 * model.embedding_params
    assert model.kv_bytes_per_token == base.model.model.kv_bytes_per_token
    saved = base.model.model.weight_bytes - model.weight_bytes
    assert quant.num_kv_blocks - base.num_kv_blocks == pytest.approx(
        saved / (model.kv_bytes_per_token * base.block_size), abs=1
    )
    for shape in (DECODE_1, DECODE_64):
        assert quant.step_time_s(shape) < base.step_time_s(shape)
    assert quant.name == f"{name}-{method}"
    assert lora_cost(quant) == lora_cost(base)  # adapters stay bf16 over quantized weights


def test_fp8_halves_the_projections_flop_time_only_on_fp8_tensor_cores() -> None:
    fp8, int8 = (quantized(BUILTIN["h100-llama3-8b"], m) for m in ("fp8", "int8"))
    assert H100.has_fp8_tensor_cores and not A100.has_fp8_tensor_cores
    # A long prefill is compute-bound: int8 weight-only dequantizes and multiplies in bf16.
    assert int8.step_time_s(PREFILL) == BUILTIN["h100-llama3-8b"].step_time_s(PREFILL)
    assert isinstance(fp8.model, Roofline)
    embedding = fp8.model.model.embedding_params
    # The projections' 2 FLOPs a parameter a token at twice the peak: as 1 FLOP at the bf16 peak.
    matmuls = (8.03e9 - embedding) * 4096 + 2 * embedding * 4096
    flops = matmuls + 4 * 32 * 32 * 128 * PREFILL.num_attn_pairs
    assert fp8.step_time_s(PREFILL) == pytest.approx(1e-3 + 10e-6 + flops / (989e12 * 0.6), rel=1e-12)
    a100 = BUILTIN["a100-llama3-8b"]
    assert quantized(a100, "fp8") == a100  # dequantized at load there: nothing saved, nothing faster


def _decode_step_s(profile: Profile) -> tuple[int, float]:
    """A simulated replica's KV blocks and the duration of its decode step with 8 requests."""
    engine = SimEngine(profile, NullTokenizer(), "sim")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", list(range(3, 515)), params)
    durations = []
    while (step := engine.begin_step()) is not None:
        durations.append(step.duration_s)
        engine.finish_step(step)
    return engine.block_manager.num_blocks, durations[-1]


def test_quantization_flag_and_checkpoint_config_reach_the_replica(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    argv = ["--model", str(tiny_model_dir), "--simulate", "h100-llama3-8b"]
    plain = replica_spec(*_engine_args(argv)).profile
    fp8 = replica_spec(*_engine_args([*argv, "--quantization", "fp8"])).profile
    assert plain == BUILTIN["h100-llama3-8b"]
    assert fp8 == quantized(plain, "fp8")
    plain_blocks, plain_decode_s = _decode_step_s(plain)
    fp8_blocks, fp8_decode_s = _decode_step_s(fp8)
    assert fp8_blocks > plain_blocks and fp8_decode_s < plain_decode_s
    # An FP8 checkpoint is simulated as fp8 without the flag, in either format.
    for config in (FP8_BLOCK, FP8_COMPRESSED):
        ckpt = _checkpoint(tmp_path / config["quant_method"], tiny_model_dir, config)
        assert checkpoint_quantization(ckpt) == "fp8"
        spec = replica_spec(*_engine_args(["--model", str(ckpt), "--simulate", "h100-llama3-8b"]))
        assert spec.profile == fp8
    # The flag wins over the checkpoint, as on the engine.
    int8 = replica_spec(
        *_engine_args(["--model", str(ckpt), "--simulate", "h100-llama3-8b", "--quantization", "int8"])
    )
    assert int8.profile == quantized(plain, "int8")
    # Sizing flags still apply after: the quantized weights leave more of less memory.
    half = replica_spec(*_engine_args([*argv, "--quantization", "fp8", "--gpu-memory-utilization", "0.45"]))
    assert half.profile.num_kv_blocks > with_overrides(plain, {"gpu_memory_utilization": 0.45}).num_kv_blocks


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "int4"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, None),  # dequantized by the engine
        (_pack_quantized(4), "int4"),
        (_pack_quantized(8), None),
    ],
)
def test_int_checkpoints_are_simulated_as_the_engine_runs_them(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, config: dict[str, object], expected: str | None
) -> None:
    """4-bit AWQ/GPTQ/W4A16 weights at ~0.53 bytes a projection parameter (more KV blocks and
    shorter decode steps than int8's 1 byte); 8-bit ones as the model dtype, as the engine
    dequantizes them; --quantization naming the checkpoint's own format reads the checkpoint."""
    ckpt = _checkpoint(tmp_path, tiny_model_dir, config)
    assert checkpoint_quantization(ckpt) == expected
    plain = BUILTIN["h100-llama3-8b"]
    want = plain if expected is None else quantized(plain, expected)
    spec = replica_spec(*_engine_args(["--model", str(ckpt), "--simulate", "h100-llama3-8b"]))
    assert spec.profile == want
    method = str(config["quant_method"])
    flagged = replica_spec(
        *_engine_args(["--model", str(ckpt), "--simulate", "h100-llama3-8b", "--quantization", method])
    )
    assert flagged.profile == want
    if expected == "int4":
        int8 = quantized(plain, "int8")
        assert want.num_kv_blocks > int8.num_kv_blocks
        assert want.step_time_s(DECODE_1) < int8.step_time_s(DECODE_1)
        assert want.step_time_s(PREFILL) == plain.step_time_s(PREFILL)  # multiplied in bf16
        assert isinstance(want.model, Roofline)
        model = want.model.model
        assert model.weight_bytes == pytest.approx(
            model.num_projection_params * (0.5 + 4 / 128) + 2 * model.embedding_params
        )


@pytest.mark.parametrize(
    "config",
    [
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        {"quant_method": "gguf"},
        {**FP8_COMPRESSED, "config_groups": {"g": {"weights": {"type": "int", "num_bits": 2}}}},
        "fp8",
    ],
)
def test_a_quantization_the_engine_refuses_stops_the_replica(
    tiny_model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    config: object,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def served(*_: object) -> None:
        raise AssertionError("the replica was built: the quantization was not refused")

    monkeypatch.setattr(simulate, "build_engines", served)  # a failure, not a server that never ends
    ckpt = _checkpoint(tmp_path, tiny_model_dir, config)
    with pytest.raises(ModelLoadError, match="quantization_config"):
        checkpoint_quantization(ckpt)
    args, engine_args = _engine_args(["--model", str(ckpt), "--simulate", "h100-llama3-8b"])
    args.replicas = 1
    with caplog.at_level(logging.ERROR, logger="corral_cli.simulate"):
        assert simulate.run_simulated(args, engine_args) == 1
    assert "cannot load the model" in caplog.text and "not supported" in caplog.text


def test_a_fitted_profile_names_quantization_as_ignored(
    tiny_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["--model", str(tiny_model_dir), "--simulate", "h100-llama3-8b-corral", "--quantization", "fp8"]
    with caplog.at_level(logging.WARNING, logger="corral_cli.simulate"):
        spec = replica_spec(*_engine_args(argv))
    assert spec.profile == BUILTIN["h100-llama3-8b-corral"]
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "--quantization" in record.getMessage() and "calibrate the quantized engine" in record.getMessage()
    with pytest.raises(ValueError, match="fitted profile"):
        quantized(BUILTIN["h100-llama3-8b-corral"], "fp8")
