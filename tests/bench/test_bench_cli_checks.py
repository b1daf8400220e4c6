"""`corral bench` refuses what cannot work before the run starts, says what a server answered, and
reports unknown figures as unknown: flags, output paths, chat datasets, the models list, tables."""

from __future__ import annotations

import argparse
import json
import logging
import math

import pytest
from corral_cli.bench import report
from corral_cli.bench.stats import RequestResult, aggregate
from corral_cli.bench.workload import BenchRequest, as_chat_prompts
from corral_cli.cmd_bench import add_arguments
from corral_cli.main import main as corral_main

from .fake_openai import MODEL, FakeState, serve_fake


class _CharTokenizer:
    vocab_size = 300
    special_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture
def fake():
    with serve_fake(FakeState(token_delay_s=0.001)) as (url, state):
        yield url, state


def _bench_argv(url: str, *flags: str) -> list[str]:
    small = ["--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "3", "--ignore-eos"]
    return ["bench", "--base-url", url, *small, "--no-progress", "--no-metrics", *flags]


def test_a_refused_models_list_reports_the_servers_answer(caplog):
    with serve_fake(FakeState(api_key="sekret")) as (url, state), caplog.at_level(logging.ERROR):
        assert corral_main(_bench_argv(url, "--api-key", "bad")) == 1
    assert f"{url}/v1/models answered HTTP 401: Incorrect API key provided." in caplog.text
    assert "lists no models" not in caplog.text and state.bodies == []


def test_a_base_url_ending_in_v1_gets_a_hint(fake, caplog):
    url, state = fake
    with caplog.at_level(logging.ERROR):
        assert corral_main(_bench_argv(url + "/v1")) == 1
    assert "/v1/v1/models answered HTTP 404" in caplog.text
    assert f"drop the trailing /v1 from {url}/v1" in caplog.text
    assert "lists no models" not in caplog.text and state.bodies == []


def test_check_gives_the_same_v1_hint(fake, caplog):
    url, _ = fake
    with caplog.at_level(logging.ERROR):
        assert corral_main(["check", "--base-url", url + "/v1/"]) == 1
    assert "HTTP 404" in caplog.text and "drop the trailing /v1" in caplog.text


def test_a_given_model_goes_ahead_with_a_warning_when_the_list_is_refused(caplog):
    with serve_fake(FakeState(api_key="sekret")) as (url, _), caplog.at_level(logging.WARNING):
        assert corral_main(_bench_argv(url, "--api-key", "bad", "--model", MODEL)) == 1
    assert "answered HTTP 401" in caplog.text and "every request failed" in caplog.text


def test_without_streaming_per_token_latencies_are_unknown(fake, tmp_path, capsys):
    url, _ = fake
    result_file, plot = tmp_path / "r.json", tmp_path / "sweep.png"
    argv = _bench_argv(url, "--no-stream", "--request-rate", "200,inf")
    assert corral_main([*argv, "--result-file", str(result_file), "--plot", str(plot)]) == 0
    for run in json.loads(result_file.read_text())["runs"]:
        assert run["completed"] == 3 and run["mean_e2el_ms"] > 0
        assert all(run[f"{stat}_{kind}_ms"] is None for stat in ("mean", "p99") for kind in ("tpot", "itl"))
    assert plot.read_bytes()[:4] == b"\x89PNG"  # the sweep plot copes with the unknown series
    sweep_rows = [line for line in capsys.readouterr().out.splitlines() if "3/0" in line]
    assert len(sweep_rows) == 2 and all(row.count("n/a") == 3 for row in sweep_rows)  # TPOT, ITL, preempt
    assert corral_main([*argv[:-2], "--plot", str(tmp_path / "dist.png")]) == 0  # one run's histograms
    table = capsys.readouterr().out.splitlines()
    for name in ("TPOT", "ITL"):
        assert next(line for line in table if name in line).count("n/a") == 4


def test_preemptions_against_a_gateway_read_na_with_the_reason(tmp_path, capsys):
    # A gateway's /metrics holds its own series: n/a must say so, not pass for "none counted".
    with serve_fake(FakeState(is_gateway=True)) as (url, _):
        argv = [a for a in _bench_argv(url, "--result-file", str(tmp_path / "r.json")) if a != "--no-metrics"]
        assert corral_main([*argv, "--request-rate", "200,inf"]) == 0
        sweep = capsys.readouterr().out
        assert corral_main(argv) == 0
        single = capsys.readouterr().out
    for out in (sweep, single):
        assert "preemptions n/a:" in out and "no vllm:num_preemptions_total" in " ".join(out.split())
        assert "--metrics-url" in out
    [run] = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert run["num_preemptions"] is None and "a gateway?" in run["preemptions_unknown_why"]
    with serve_fake(FakeState()) as (url, _):  # an engine's /metrics: counted, no caption
        assert corral_main([a for a in _bench_argv(url) if a != "--no-metrics"]) == 0
    assert "preemptions n/a" not in capsys.readouterr().out


def test_a_non_streamed_result_has_no_tpot():
    whole = RequestResult(is_success=True, output_len=5, ttft_s=0.4, e2el_s=0.4, is_streamed=False)
    assert whole.tpot_s is None
    assert math.isnan(aggregate([whole], 1.0)["mean_tpot_ms"])


def test_tables_keep_every_figure_off_a_terminal(monkeypatch, capsys):
    for name in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)
    summary = aggregate([RequestResult(True, 1_000_000, 2_000_000, 1.5, 99.0, [0.1, 0.2])], 1.0)
    summary.update(request_rate=12345.0, num_preemptions=1_234_567, client_cpu_s=3.0)
    report.print_report([summary, {**summary, "request_rate": math.inf}])  # a sweep: ten columns
    sweep = capsys.readouterr().out
    report.print_report([summary])
    single = capsys.readouterr().out
    for out in (sweep, single):
        assert "…" not in out and "2,000,000.0" in out and "1,234,567" in out
    assert "ok/fail" in sweep and "1/0" in sweep and "99,000.0" in sweep


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--request-timeout", "0"),
        ("--request-timeout", "-5"),
        ("--request-timeout", "nan"),
        ("--num-prompts", "0"),
        ("--random-input-len", "0"),
        ("--random-output-len", "-1"),
        ("--burstiness", "0"),
        ("--max-concurrency", "0"),
        ("--max-tokens-cap", "0"),
        ("--random-sigma", "0"),
        ("--temperature", "-0.5"),
    ],
)
def test_numbers_that_make_no_sense_are_argument_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        corral_main(["bench", "--base-url", "http://127.0.0.1:9", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: expected" in capsys.readouterr().err


def test_output_paths_are_checked_before_the_run(fake, tmp_path, caplog):
    url, state = fake
    result_file = tmp_path / "new" / "deeper" / "r.json"
    assert corral_main(_bench_argv(url, "--result-file", str(result_file))) == 0
    assert json.loads(result_file.read_text())["runs"][0]["completed"] == 3
    num_sent = len(state.bodies)
    (tmp_path / "file").write_text("")
    refused = [
        (["--plot", str(tmp_path / "p.txt")], "matplotlib cannot write a .txt file"),
        (["--plot", str(tmp_path / "plot")], "cannot write a file without an extension"),
        (["--result-file", str(tmp_path / "file" / "r.json")], "cannot create its folder"),
        (["--result-file", str(tmp_path)], "is a directory"),
    ]
    for flags, message in refused:
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert corral_main(_bench_argv(url, *flags)) == 1
        assert message in caplog.text
    assert len(state.bodies) == num_sent  # nothing was sent for a run that could not be written


def test_token_id_prompts_for_chat_need_a_tokenizer(fake, tmp_path, caplog):
    url, state = fake
    dataset = tmp_path / "ids.jsonl"
    dataset.write_text('{"prompt": [104, 105], "output_len": 2}\n{"prompt": "hello", "output_len": 2}\n')
    with caplog.at_level(logging.ERROR):
        assert corral_main(_bench_argv(url, "--endpoint-type", "chat", "--dataset", str(dataset))) == 1
    assert "token-id prompts" in caplog.text and "--tokenizer" in caplog.text
    assert state.bodies == []


def test_token_id_prompts_are_decoded_for_chat():
    requests = [BenchRequest([104, 105], 2, 3), BenchRequest("hello", 5, 4)]
    assert as_chat_prompts(requests, _CharTokenizer()) == [BenchRequest("hi", 2, 3), requests[1]]
    assert as_chat_prompts(requests[1:], None) == requests[1:]
    with pytest.raises(ValueError, match="--tokenizer"):
        as_chat_prompts(requests, None)


def test_an_empty_request_rate_entry_is_refused(caplog):
    with caplog.at_level(logging.ERROR):
        assert corral_main(["bench", "--base-url", "http://127.0.0.1:9", "--request-rate", "1,,2"]) == 1
    assert "empty entry" in caplog.text


def test_every_bench_option_has_a_description():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert bare == []
