"""Engine flags under `--simulate`: a roofline profile sizes its KV cache from --kv-cache-memory or
--gpu-memory-utilization as the engine does; what a profile cannot honour (tensor parallelism,
dtype, speculation, a fitted profile's KV bytes) is named in one warning at start-up, never
silently dropped; and `corral up --simulate` passes none of those flags."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib

import pytest
from corral_cli import cmd_engine, cmd_up
from corral_cli.simulate import replica_spec
from corral_engine.args import OPTIONS, EngineArgs
from corral_engine.sim.host import ignored_options, with_overrides
from corral_engine.sim.perf_model import BUILTIN, LLAMA3_8B, Fitted, Profile, Roofline

GIB = 1 << 30


def _engine_args(argv: list[str]) -> tuple[argparse.Namespace, EngineArgs]:
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    args = parser.parse_args(argv)
    return args, cmd_engine.engine_args_from(args)


def test_kv_cache_memory_sizes_a_roofline_profiles_blocks_per_gpu() -> None:
    one = BUILTIN["h100-llama3-8b"]
    # 128 KiB a token for Llama-3-8B in bf16: 4 GiB hold 32,768 tokens, 2,048 blocks of 16.
    assert LLAMA3_8B.kv_bytes_per_token == 128 << 10
    assert with_overrides(one, {"kv_cache_memory_bytes": 4 * GIB}).num_kv_blocks == 2048
    assert with_overrides(one, {"kv_cache_memory_bytes": 4 * GIB, "block_size": 32}).num_kv_blocks == 1024
    # Per rank, as the engine reads it: 4 GPUs each hold a quarter of every token's KV.
    four = BUILTIN["h100-llama3-70b"]
    assert isinstance(four.model, Roofline) and four.model.num_gpus == 4
    per_gpu_block = 16 * four.model.model.kv_bytes_per_token // 4
    assert with_overrides(four, {"kv_cache_memory_bytes": 4 * GIB}).num_kv_blocks == 4 * GIB // per_gpu_block
    with pytest.raises(ValueError, match="holds no block"):
        with_overrides(one, {"kv_cache_memory_bytes": 1000})


def test_gpu_memory_utilization_sizes_a_roofline_profiles_blocks() -> None:
    profile = BUILTIN["h100-llama3-8b"]
    assert with_overrides(profile, {"gpu_memory_utilization": 0.9}).num_kv_blocks == profile.num_kv_blocks
    half = with_overrides(profile, {"gpu_memory_utilization": 0.45}).num_kv_blocks
    assert 0 < half < profile.num_kv_blocks / 2  # the weights take a larger share of less memory
    # --num-kv-blocks wins, as on the engine; --kv-cache-memory before the utilization.
    assert with_overrides(profile, {"gpu_memory_utilization": 0.5, "num_kv_blocks": 7}).num_kv_blocks == 7
    both = {"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 4 * GIB}
    assert with_overrides(profile, both).num_kv_blocks == 2048


def test_the_flags_a_profile_cannot_honour_are_named_in_one_warning(
    tiny_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["--model", str(tiny_model_dir), "--simulate", "h100-llama3-8b-corral"]
    argv += ["--tensor-parallel-size", "2", "--speculative", "ngram", "--dtype", "float16"]
    argv += ["--kv-cache-memory", "4Gi"]
    argv += ["--gpu-memory-utilization", "0.5", "--max-num-seqs", "8"]
    args, engine_args = _engine_args(argv)
    with caplog.at_level(logging.WARNING, logger="corral_cli.simulate"):
        spec = replica_spec(args, engine_args)
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = record.getMessage()
    named = ("--tensor-parallel-size", "--speculative", "--dtype", "--gpu-memory-utilization")
    assert all(flag in message for flag in named)
    assert "h100-llama3-8b-corral" in message and "--num-kv-blocks" in message
    # The fitted built-in knows a token's KV bytes (Llama-3-8B in bf16), so it honours
    # --kv-cache-memory; it knows no GPU memory, so not --gpu-memory-utilization.
    assert "--kv-cache-memory" not in message.split("; ")[0]
    fitted = BUILTIN["h100-llama3-8b-corral"]
    assert spec.profile == dataclasses.replace(fitted, max_num_seqs=8, num_kv_blocks=2048)
    # A roofline profile honours the two KV flags, so only the fixed ones are named.
    args, engine_args = _engine_args([*argv[:3], "h100-llama3-8b", *argv[4:]])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="corral_cli.simulate"):
        spec = replica_spec(args, engine_args)
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "--dtype" in record.getMessage() and "--kv-cache-memory" not in record.getMessage()
    assert spec.profile.num_kv_blocks == 2048


def test_no_warning_without_such_flags(
    tiny_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    args, engine_args = _engine_args(["--model", str(tiny_model_dir), "--simulate", "h100-llama3-8b"])
    with caplog.at_level(logging.WARNING, logger="corral_cli.simulate"):
        replica_spec(args, engine_args)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_corral_up_simulate_passes_no_flag_the_profile_ignores(tmp_path: pathlib.Path) -> None:
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    up_argv = ["--model", str(tmp_path), "--simulate", "h100-llama3-8b-corral", "--replicas", "4"]
    up_args = parser.parse_args(up_argv)
    [[flags]] = cmd_up._fleet(up_args).values()
    # What local_engines.LocalEngine adds to each engine process's flags.
    argv = [*flags, "--host", "127.0.0.1", "--port", "9000", "--num-threads", "2", "--replicas", "4"]
    args, _ = _engine_args(argv)
    given = {name: getattr(args, name, None) for name in OPTIONS}
    assert ignored_options(BUILTIN["h100-llama3-8b-corral"], given) == []


@pytest.mark.parametrize("name", ["h100-llama3-8b", "h100-llama3-8b-corral"])
def test_block_size_alone_keeps_the_kv_memory_not_the_block_count(name: str) -> None:
    # The engine divides the same bytes by the new block size: twice the blocks of half the size.
    profile = BUILTIN[name]
    tokens = profile.num_kv_blocks * profile.block_size
    for block_size in (8, 32, 64):
        resized = with_overrides(profile, {"block_size": block_size})
        assert resized.block_size == block_size
        assert resized.num_kv_blocks == tokens // block_size
    assert with_overrides(profile, {"block_size": 32, "num_kv_blocks": 100}).num_kv_blocks == 100
    assert with_overrides(profile, {"block_size": 16}).num_kv_blocks == profile.num_kv_blocks


def test_a_fitted_profile_with_kv_bytes_honours_kv_cache_memory_and_one_without_names_it(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorded = Profile(
        "cpu-tiny", Fitted((1e-3, 0.0, 0.0, 0.0, 0.0)), num_kv_blocks=64, kv_bytes_per_token=256
    )
    assert with_overrides(recorded, {"kv_cache_memory_bytes": 1 << 20}).num_kv_blocks == (1 << 20) // (
        256 * 16
    )
    with pytest.raises(ValueError, match="holds no block"):
        with_overrides(recorded, {"kv_cache_memory_bytes": 256 * 16 - 1})
    # A profile file written before calibrate recorded the bytes keeps its size and says why.
    old = tmp_path / "old.json"
    old.write_text(
        '{"kind": "fitted", "name": "old", "num_kv_blocks": 64, "coefficients": [0.001, 0, 0, 0, 0]}'
    )
    args, engine_args = _engine_args(
        ["--model", str(tiny_model_dir), "--simulate", str(old), "--kv-cache-memory", "1Mi"]
    )
    with caplog.at_level(logging.WARNING, logger="corral_cli.simulate"):
        spec = replica_spec(args, engine_args)
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "--kv-cache-memory" in record.getMessage() and "corral calibrate" in record.getMessage()
    assert spec.profile.num_kv_blocks == 64
