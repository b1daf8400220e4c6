"""`corral bench --endpoint-type embeddings|rerank`: inputs grouped into requests, bodies, replies
checked, figures without generation (no TTFT, TPOT or output: null, not 0), tables and plots."""

from __future__ import annotations

import argparse
import json
import logging
import math

import pytest
from corral_cli.bench import report
from corral_cli.bench.client import RequestSettings
from corral_cli.bench.pooling import PoolingRequest, build_pooling_body, check_reply, group_inputs
from corral_cli.bench.stats import RequestResult, aggregate
from corral_cli.bench.workload import BenchRequest
from corral_cli.cmd_bench import _load_workloads, add_arguments
from corral_cli.main import main as corral_main

from .fake_openai import MODEL, FakeState, serve_fake


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _prompts(*texts_or_ids: str | list[int]) -> list[BenchRequest]:
    return [BenchRequest(p, len(p), 0) for p in texts_or_ids]


def test_embeddings_group_consecutive_inputs_and_sum_their_lengths():
    requests = group_inputs(_prompts([1, 2], [3], [4, 5, 6], [7]), "embeddings", 2)
    assert requests == [PoolingRequest([[1, 2], [3]], 3), PoolingRequest([[4, 5, 6], [7]], 4)]


def test_rerank_takes_a_query_then_its_documents_and_refuses_token_ids():
    (request,) = group_inputs(_prompts("q", "d one", "d two"), "rerank", 2)
    assert (request.query, request.inputs, request.prompt_len) == ("q", ["d one", "d two"], 11)
    with pytest.raises(ValueError, match="--tokenizer"):
        group_inputs(_prompts([1], [2]), "rerank", 1)
    with pytest.raises(ValueError, match="requests of 3"):
        group_inputs(_prompts("a", "b"), "rerank", 2)


def test_bodies_are_vllms_embeddings_and_rerank_shapes():
    embed = RequestSettings("http://x", "m", endpoint_type="embeddings")
    assert build_pooling_body(embed, PoolingRequest([[1, 2]], 2)) == {
        "model": "m",
        "input": [[1, 2]],
        "encoding_format": "float",
    }
    rerank = RequestSettings("http://x", "m", endpoint_type="rerank")
    body = build_pooling_body(rerank, PoolingRequest(["a", "b"], 3, query="q"))
    assert body == {"model": "m", "query": "q", "documents": ["a", "b"]}


def test_a_reply_counts_the_servers_tokens_and_needs_one_result_per_input():
    usage = {"prompt_tokens": 9, "total_tokens": 9}
    assert check_reply("embeddings", {"data": [{}, {}], "usage": usage}, 2) == (9, "")
    assert check_reply("rerank", {"results": [{}], "usage": usage}, 1) == (9, "")
    assert check_reply("embeddings", {"data": [{}], "usage": usage}, 2) == (
        None,
        "answered 1 results for 2 inputs",
    )
    assert check_reply("embeddings", {"data": [{}]}, 1) == (None, "response without usage")
    assert check_reply("rerank", [], 1)[1] == "the answer is not a JSON object"


def _pooling_result(e2el_s: float, prompt_len: int = 10, num_inputs: int = 2) -> RequestResult:
    return RequestResult(
        is_success=True,
        prompt_len=prompt_len,
        num_inputs=num_inputs,
        e2el_s=e2el_s,
        is_streamed=False,
        is_generation=False,
    )


def test_a_pooling_run_has_no_generation_figures_and_counts_inputs():
    failed = RequestResult(error="HTTP 400: nope", is_streamed=False, is_generation=False)
    results = [_pooling_result(0.1), _pooling_result(0.3), failed]
    summary = aggregate(results, 2.0, is_generation=False)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (2, 1, {"HTTP 400: nope": 1})
    assert summary["total_output_tokens"] is None and summary["output_throughput"] is None
    assert all(math.isnan(summary[f"mean_{kind}_ms"]) for kind in ("ttft", "tpot", "itl"))
    assert summary["mean_e2el_ms"] == pytest.approx(200.0)
    assert (summary["total_inputs"], summary["input_item_throughput"]) == (4, 2.0)
    assert (summary["request_throughput"], summary["input_throughput"]) == (1.0, 10.0)
    assert "total_inputs" not in aggregate([RequestResult(is_success=True)], 1.0)  # generation


def _pooling_summary(rate: float) -> dict:
    summary = aggregate([_pooling_result(0.1), _pooling_result(0.2)], 1.0, is_generation=False)
    return {**summary, "request_rate": rate, "num_preemptions": 0, "client_cpu_s": 0.01}


def test_tables_show_inputs_and_end_to_end_latency_only():
    console = report.Console(width=200, record=True)
    report.print_report([_pooling_summary(4.0)], console)
    report.print_report([_pooling_summary(4.0), _pooling_summary(math.inf)], console)
    text = console.export_text()
    assert "input throughput (inputs/s)" in text and "client CPU per input (µs)" in text
    assert "E2E latency" in text and "E2E p90" in text and "inputs/s" in text
    assert "TTFT" not in text and "TPOT" not in text and "output" not in text


def test_plots_of_a_pooling_run_and_sweep(tmp_path):
    sweep, single = tmp_path / "sweep.png", tmp_path / "one.png"
    report.plot_sweep([_pooling_summary(2.0), _pooling_summary(math.inf)], sweep, "embeddings")
    report.plot_latency_distributions([_pooling_result(0.1), _pooling_result(0.2)], single, "one run")
    assert sweep.read_bytes()[:4] == single.read_bytes()[:4] == b"\x89PNG"


def test_workloads_take_batch_size_prompts_per_request():
    args = _args("--endpoint-type", "embeddings", "--embedding-batch-size", "4", "--num-prompts", "3")
    (run,), warmup, lengths_from = _load_workloads(args, 1)
    assert len(run) == 3 and warmup == [] and lengths_from == "exact"
    assert all(len(r.inputs) == 4 and all(len(ids) == 128 for ids in r.inputs) for r in run)
    args = _args("--endpoint-type", "rerank", "--embedding-batch-size", "2", "--num-prompts", "2")
    args.random_input_len, args.warmup_requests = 3, 1
    (run, run2), warmup, lengths_from = _load_workloads(args, 2)
    assert lengths_from == "estimated" and len(warmup) == 1
    assert all(isinstance(r.query, str) and len(r.inputs) == 2 for r in [*run, *run2, *warmup])
    assert run[0].inputs != run2[0].inputs  # fresh texts per run


def test_a_token_id_dataset_cannot_be_reranked_without_a_tokenizer(tmp_path, caplog):
    dataset = tmp_path / "ids.jsonl"
    dataset.write_text('{"prompt": [5, 6, 7], "output_len": 1}\n')
    argv = [
        "bench",
        "--endpoint-type",
        "rerank",
        "--dataset",
        str(dataset),
        "--base-url",
        "http://127.0.0.1:9",
    ]
    with caplog.at_level(logging.ERROR):
        assert corral_main([*argv, "--no-progress"]) == 1
    assert "--endpoint-type rerank sends text" in caplog.text


def test_a_generation_only_flag_is_refused(caplog):
    argv = [
        "bench",
        "--endpoint-type",
        "embeddings",
        "--max-tokens-cap",
        "8",
        "--base-url",
        "http://127.0.0.1:9",
    ]
    with caplog.at_level(logging.ERROR):
        assert corral_main(argv) == 1
    assert "--endpoint-type embeddings has none" in caplog.text


def test_an_embeddings_sweep_counts_the_servers_tokens(tmp_path):
    result_file = tmp_path / "r.json"
    argv = ["bench", "--endpoint-type", "embeddings", "--embedding-batch-size", "3", "--num-prompts", "4"]
    argv += ["--random-input-len", "5", "--request-rate", "500,inf", "--no-metrics", "--no-progress"]
    argv += ["--embedding-encoding", "base64"]
    with serve_fake() as (url, state):
        assert corral_main([*argv, "--base-url", url, "--result-file", str(result_file)]) == 0
    assert all(len(b["input"]) == 3 and b["model"] == MODEL for b in state.bodies)
    assert {b["encoding_format"] for b in state.bodies} == {"base64"}
    doc = json.loads(result_file.read_text())
    assert doc["benchmark"]["embedding_batch_size"] == 3 and doc["benchmark"]["random_output_len"] is None
    assert doc["benchmark"]["embedding_encoding"] == "base64"
    for run in doc["runs"]:
        assert (run["endpoint_type"], run["completed"], run["total_inputs"]) == ("embeddings", 4, 12)
        assert run["total_input_tokens"] == 12 * (5 + 2)  # the server's usage: 2 special tokens each
        assert run["total_output_tokens"] is None and run["p99_ttft_ms"] is None
        assert run["median_e2el_ms"] > 0 and run["input_item_throughput"] > 0


def test_every_request_refused_is_a_failure_count_not_a_crash(caplog, tmp_path):
    result_file = tmp_path / "r.json"
    argv = ["bench", "--endpoint-type", "embeddings", "--num-prompts", "3", "--model", "other"]
    with serve_fake(FakeState()) as (url, _), caplog.at_level(logging.ERROR):
        code = corral_main(
            [*argv, "--base-url", url, "--no-metrics", "--no-progress", "--result-file", str(result_file)]
        )
    assert code == 1 and "every request failed" in caplog.text and "HTTP 404: no such model" in caplog.text
    (run,) = json.loads(result_file.read_text())["runs"]
    assert (run["completed"], run["failed"], run["errors"]) == (0, 3, {"HTTP 404: no such model": 3})
