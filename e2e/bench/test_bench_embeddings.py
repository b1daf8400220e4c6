"""`corral bench --endpoint-type embeddings|rerank` against real engines serving the demo BERT
(`--runner pooling`) and its reranker; a generating engine's 400s are failures counted, not a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from corral_engine.demo_encoder import write_demo_encoder
from corral_engine.wire import PROMPT_TOKENS_TOTAL

from e2e.procs import EngineProcess, start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "corral_cli.main", "bench", "--no-progress", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_encoder(tmp_path_factory.mktemp("bert") / "bert", arch="bert")


@pytest.fixture(scope="module")
def bert_engine(bert_dir: Path) -> Iterator[EngineProcess]:
    with start_engine(bert_dir, runner="pooling") as engine:
        yield engine


def test_a_short_run_counts_the_servers_tokens(bert_engine: EngineProcess, bert_dir: Path, tmp_path: Path):
    for extra, exact in (([], True), (["--tokenizer", str(bert_dir)], False)):
        result_file = tmp_path / "result.json"
        before = bert_engine.metric(PROMPT_TOKENS_TOTAL)
        proc = _bench(
            "--base-url", bert_engine.url, "--endpoint-type", "embeddings", "--embedding-batch-size", "4",
            "--num-prompts", "6", "--random-input-len", "16", "--result-file", str(result_file), *extra,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        served = bert_engine.metric(PROMPT_TOKENS_TOTAL) - before
        doc = json.loads(result_file.read_text())
        assert doc["benchmark"]["endpoint_type"] == "embeddings"
        assert doc["benchmark"]["embedding_batch_size"] == 4
        (run,) = doc["runs"]
        assert (run["completed"], run["failed"], run["total_inputs"]) == (6, 0, 24)
        # Token ids go in as they are; text gets the encoder's [CLS] and [SEP] on the server.
        assert run["total_input_tokens"] == served
        assert (served == 24 * 16) is exact
        assert run["total_output_tokens"] is None and run["output_throughput"] is None
        assert all(run[f"mean_{kind}_ms"] is None for kind in ("ttft", "tpot", "itl"))
        assert 0 < run["median_e2el_ms"] <= run["p90_e2el_ms"] <= run["p99_e2el_ms"]
        assert run["input_item_throughput"] == pytest.approx(4 * run["request_throughput"])
        assert "input throughput (inputs/s)" in proc.stdout and "TTFT" not in proc.stdout


def test_a_rate_sweep_with_its_plot(bert_engine: EngineProcess, tmp_path: Path):
    result_file, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = _bench(
        "--base-url", bert_engine.url, "--endpoint-type", "embeddings", "--num-prompts", "8",
        "--random-input-len", "8", "--request-rate", "40,inf", "--max-concurrency", "4",
        "--result-file", str(result_file), "--plot", str(plot),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(result_file.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [40.0, "inf"]
    for run in runs:
        assert (run["completed"], run["failed"], run["max_concurrency"]) == (8, 0, 4)
        assert run["total_input_tokens"] == 8 * 8 and run["p99_e2el_ms"] > 0
    assert "E2E p99" in proc.stdout and plot.read_bytes()[:4] == b"\x89PNG"


def test_rerank_sends_a_query_and_its_documents(tmp_path: Path):
    reranker = write_demo_encoder(tmp_path / "rr", arch="bert", is_reranker=True)
    result_file = tmp_path / "rerank.json"
    with start_engine(reranker) as engine:
        before = engine.metric(PROMPT_TOKENS_TOTAL)
        proc = _bench(
            "--base-url", engine.url, "--endpoint-type", "rerank", "--embedding-batch-size", "3",
            "--num-prompts", "4", "--random-input-len", "6", "--result-file", str(result_file),
        )  # fmt: skip
        served = engine.metric(PROMPT_TOKENS_TOTAL) - before
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(result_file.read_text())["runs"]
    assert (run["completed"], run["failed"], run["total_inputs"]) == (4, 0, 12)
    assert run["total_input_tokens"] == served > 12 * 6  # each pair: query, document, specials


def test_a_generating_engine_answers_400s_counted_as_failures(tiny_model_dir: Path, tmp_path: Path):
    result_file = tmp_path / "refused.json"
    with start_engine(tiny_model_dir) as engine:
        proc = _bench(
            "--base-url", engine.url, "--endpoint-type", "embeddings", "--num-prompts", "5",
            "--random-input-len", "4", "--result-file", str(result_file),
        )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "every request failed" in proc.stderr and "--runner generate" in proc.stderr
    (run,) = json.loads(result_file.read_text())["runs"]
    assert (run["completed"], run["failed"]) == (0, 5)
    ((error, count),) = run["errors"].items()
    assert error.startswith("HTTP 400: ") and count == 5
    assert "completed / failed" in proc.stdout and "0 / 5" in proc.stdout
