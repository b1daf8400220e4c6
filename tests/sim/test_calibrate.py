"""`corral calibrate` times the real engine's steps and writes a profile `--simulate` loads."""

from __future__ import annotations

import json
import pathlib

import pytest
from corral_cli.main import main
from corral_engine.sim.perf_model import Fitted, StepShape, load_profile


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
    one = profile.step_time_s(StepShape(1, 1, 16, 16.0))
    many = profile.step_time_s(StepShape(512, 32, 4096, 50_000.0))
    assert 0 < one <= many  # non-negative coefficients: more work never takes less time
