"""`python -m bench.experiments preemptions --quick` against real tiny engines: result, table, plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.experiments.__main__ import main as experiments_main

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_quick_preemption_experiment(tiny_model_dir: Path, tmp_path: Path):
    argv = ["preemptions", "--quick", "--out", str(tmp_path), "--model", str(tiny_model_dir), "--no-progress"]
    assert experiments_main(argv) == 0
    out = tmp_path / "preemptions"
    doc = json.loads((out / "result.json").read_text())
    assert doc["benchmark"]["engine_source"].startswith("working tree")
    few, many = doc["runs"]  # 48 KV blocks: 2 sequences of 64 + 64 fit, 8 do not
    assert (few["max_num_seqs"], many["max_num_seqs"]) == (2, 8)
    for run in (few, many):
        assert (run["completed"], run["failed"]) == (16, 0)
        assert run["total_output_tokens"] == 16 * 64
    assert few["num_preemptions"] == 0 and many["num_preemptions"] > 0
    assert "| max_num_seqs |" in (out / "table.md").read_text()
    assert (out / "experiments-preemptions.png").read_bytes()[:4] == b"\x89PNG"
