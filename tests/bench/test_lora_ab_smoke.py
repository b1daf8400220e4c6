"""bench/engine/lora_ab.py end to end in its --quick form on the tiny preset (the benchmark proper
runs the small one): every arm measured, slots swapped where 6 adapters share 4, JSON and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_measures_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "engine" / "lora_ab.py"),
        "--quick",
        "--model", str(tmp_path / "tiny"),
        "--preset", "tiny",
        "--dtype", "float32",
        "--num-requests", "6",
        "--threads", "1",
        "--no-progress",
        "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((out / "lora_ab.json").read_text())
    arms = result["arms"]
    assert list(arms) == ["no-lora", "lora-base", "lora-1", "lora-4", "lora-8"]
    assert all(arm["median_tok_s"] > 0 and len(arm["tok_s"]) == 1 for arm in arms.values())
    assert arms["no-lora"]["ratios_to_no_lora"] == [1.0]
    assert arms["no-lora"]["slot_loads"] == [None] and arms["lora-base"]["slot_loads"] == [0]
    # Six requests round-robin over eight adapters: a4 and a5 were never in a slot before.
    assert arms["lora-8"]["slot_loads"][0] >= 2
    assert result["workload"]["num_requests"] == 6
    assert result["lora_base_identical_sequences"] == 6  # float32: the base path is unchanged
    assert result["cpu"]["model_name"] and result["cpu"]["flags"]
    assert (out / "lora_ab.png").read_bytes()[:4] == b"\x89PNG"
    assert "| lora-8 |" in done.stderr + done.stdout
