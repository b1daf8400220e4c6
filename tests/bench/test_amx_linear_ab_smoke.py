"""bench/engine/amx_linear_ab.py end to end on the tiny preset (the benchmark proper runs the small
one), on a CPU with AMX tiles: both sides timed every round, JSON with the CPU, and the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from corral_engine.demo_model import write_demo_model
from corral_engine.model.native import load_amx_linear
from corral_engine.settings import EngineSettings

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_times_both_sides(tmp_path: Path) -> None:
    if load_amx_linear(EngineSettings()) is None:
        pytest.skip("no AMX tiles here (or no C compiler): the benchmark has nothing to compare")
    model = write_demo_model(tmp_path / "tiny", preset="tiny", arch="llama")
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(ROOT / "bench" / "engine" / "amx_linear_ab.py"),
        "--model", str(model), "--batch", "3", "--prompt-len", "40", "--output-len", "3",
        "--rounds", "2", "--threads", "1", "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((out / "amx_linear_ab.json").read_text())
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in [result["ratios_onednn_over_amx"]])
    assert set(result["seconds_median"]) == {"onednn", "amx"}
    on_amx, total = map(int, result["layers_on_amx"].split(" of "))
    assert 0 < on_amx <= total
    assert 0 <= result["identical_sequences"] <= 3
    assert result["cpu"]["model_name"] and "amx_bf16" in result["cpu"]["flags"]
    assert (out / "amx_linear_ab.png").read_bytes()[:4] == b"\x89PNG"
