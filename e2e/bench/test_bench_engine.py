"""`corral bench` as a user runs it, against a real `corral engine` serving the tiny demo model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from corral_engine.wire import NUM_PREEMPTIONS_TOTAL

from e2e.procs import start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "corral_cli.main", "bench", "--no-progress", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def test_random_workload_counts_tokens_and_preemptions(tiny_model_dir: Path, tmp_path: Path):
    # 16 requests x (64 + 32) tokens need 96 blocks of 16; 24 blocks force preemptions.
    with start_engine(tiny_model_dir, num_kv_blocks=24, max_num_seqs=16) as engine:
        before = engine.metric(NUM_PREEMPTIONS_TOTAL)
        result_file = tmp_path / "result.json"
        proc = _bench(
            "--base-url", engine.url, "--num-prompts", "16", "--request-rate", "inf",
            "--random-input-len", "64", "--random-output-len", "32", "--ignore-eos",
            "--tokenizer", str(tiny_model_dir), "--result-file", str(result_file),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        preempted = engine.metric(NUM_PREEMPTIONS_TOTAL) - before

    doc = json.loads(result_file.read_text())
    assert doc["benchmark"]["model"] == engine.served_model_name
    (run,) = doc["runs"]
    assert (run["completed"], run["failed"]) == (16, 0)
    assert run["total_input_tokens"] == 16 * 64  # token-id prompts: exact lengths
    assert run["total_output_tokens"] == 16 * 32  # --ignore-eos: exactly what was asked
    assert preempted > 0
    assert run["num_preemptions"] == preempted
    for kind in ("ttft", "tpot", "e2el"):
        assert 0 < run[f"median_{kind}_ms"] <= run[f"p99_{kind}_ms"]
    # Every event of one network read is timed at that read, so a client that falls behind the
    # engine (a busy CI machine: the tiny model's steps take about a millisecond) reads several
    # tokens' events at once and most gaps are 0; the long ones between reads remain.
    assert 0 <= run["median_itl_ms"] <= run["p99_itl_ms"]
    assert run["p99_itl_ms"] > 0
    assert run["mean_ttft_ms"] < run["mean_e2el_ms"]
    assert "TTFT" in proc.stdout and "server preemptions" in proc.stdout


def test_sharegpt_chat_sweep_with_plot(tiny_model_dir: Path, tmp_path: Path):
    turns = [
        ("Tell me a short story about a cat who learns to read.", "Once upon a time there was a cat. " * 3),
        (
            "What is a corral, and what does this project keep in one?",
            "A pen for animals; here, models. " * 2,
        ),
        ("How are you today? Please answer in a few words.", "I am fine, thank you, and you? " * 2),
    ]
    entries = [
        {"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for i, (q, a) in enumerate(turns)
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(entries))
    result_file, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with start_engine(tiny_model_dir) as engine:
        proc = _bench(
            "--base-url", engine.url, "--endpoint-type", "chat", "--dataset", str(dataset),
            "--tokenizer", str(tiny_model_dir), "--num-prompts", "3", "--request-rate", "50,inf",
            "--ignore-eos", "--result-file", str(result_file), "--plot", str(plot),
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(result_file.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [50.0, "inf"]
    for run in runs:
        assert (run["completed"], run["failed"]) == (3, 0)
        assert run["total_output_tokens"] > 0 and run["output_throughput"] > 0
    assert runs[0]["total_output_tokens"] == runs[1]["total_output_tokens"]  # same workload, ignore_eos
    assert plot.read_bytes()[:4] == b"\x89PNG"
