"""`corral calibrate` times the real engine's steps and writes a profile `--simulate` loads."""

from __future__ import annotations

import json
import pathlib

import pytest
from corral_cli import cmd_calibrate
from corral_cli.main import main
from corral_engine.args import EngineArgs
from corral_engine.llm_engine import LLMEngine
from corral_engine.sim.host import with_overrides
from corral_engine.sim.perf_model import Fitted, Profile, StepShape, load_profile


@pytest.mark.slow
def test_calibrate_writes_a_fitted_profile_the_simulator_loads(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--model", str(tiny_model_dir), "--out", str(out), "--repeats", "1"]) == 0
    data = json.loads(out.read_text())
    assert data["num_steps"] > 50 and data["kind"] == "fitted"
    profile = load_profile(str(out))
    assert isinstance(profile.model, Fitted) and profile.max_model_len == data["max_model_len"]
    assert profile.kv_bytes_per_token == data["kv_bytes_per_token"] > 0  # so --kv-cache-memory works
    one = profile.step_time_s(StepShape(1, 1, 16, 16.0))
    many = profile.step_time_s(StepShape(512, 32, 4096, 50_000.0))
    assert 0 < one <= many  # non-negative coefficients: more work never takes less time


@pytest.mark.parametrize("block_size", [16, 32])
def test_the_kv_bytes_calibrate_records_size_blocks_as_the_engine_does(
    tiny_model_dir: pathlib.Path, block_size: int
) -> None:
    budget = 3 << 18  # 768 KiB: not a whole number of the tiny model's blocks at either size
    args = EngineArgs(model=str(tiny_model_dir), kv_cache_memory_bytes=budget, block_size=block_size)
    with LLMEngine(args) as engine:
        per_token = cmd_calibrate._kv_bytes_per_token(engine)
        num_engine_blocks = engine.runner.num_kv_blocks
    profile = Profile(
        "cpu-tiny", Fitted((1e-3, 0.0, 0.0, 0.0, 0.0)), 1, block_size=block_size, kv_bytes_per_token=per_token
    )
    assert with_overrides(profile, {"kv_cache_memory_bytes": budget}).num_kv_blocks == num_engine_blocks
