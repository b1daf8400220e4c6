"""bench/engine/quant_ab.py end to end in its --quick form on the tiny preset (the benchmark proper
runs the small one): both arms measured, the int8 arm's projections smaller, JSON, table and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_measures_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "engine" / "quant_ab.py"),
        "--quick",
        "--model", str(tmp_path / "tiny"),
        "--preset", "tiny",
        "--dtype", "float32",
        "--num-requests", "4",
        "--decode-tokens", "4",
        "--threads", "1",
        "--kv-cache-memory", "64Mi",
        "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((out / "quant_ab.json").read_text())
    arms = result["arms"]
    assert list(arms) == ["plain", "int8", "awq"]
    assert all(arm["median_tok_s"] > 0 and arm["median_decode_ms"] > 0 for arm in arms.values())
    assert all(len(arm["tok_s"]) == 1 and len(arm["decode_ms"]) == 1 for arm in arms.values())
    # int8 holds a byte a weight (and a float32 scale a row) where float32 holds four.
    plain, int8 = arms["plain"]["weight_mib"], arms["int8"]["weight_mib"]
    assert int8["projections"] < plain["projections"] / 3 and int8["model"] < plain["model"]
    assert result["workload"]["num_requests"] == 4 and result["num_sequences"] == 4
    assert all(0 <= n <= 4 for n in result["identical_sequences"].values())
    assert [len(r) for r in result["tok_s_ratios"].values()] == [1, 1]
    assert list(result["decode_ms_ratios"]) == ["int8", "awq"]
    assert result["cpu"]["model_name"] and result["cpu"]["flags"]
    assert (out / "quant_ab.png").read_bytes()[:4] == b"\x89PNG"
    assert "| int8 |" in done.stderr + done.stdout and "| awq |" in done.stderr + done.stdout
