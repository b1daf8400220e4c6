"""`corral bench` against a fake OpenAI-compatible SSE server: timing, errors, concurrency, metrics, CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket

import pytest
from corral_cli.bench.client import RequestSettings, send_request
from corral_cli.bench.runner import RunSettings, make_client, run_async, run_once
from corral_cli.bench.workload import BenchRequest
from corral_cli.main import main as corral_main

from .fake_openai import MODEL, FakeState, serve_fake


@pytest.fixture
def fake():
    with serve_fake(FakeState(token_delay_s=0.001)) as (url, state):
        yield url, state


async def test_completion_stream_is_timed_per_chunk(fake):
    url, state = fake
    settings = RequestSettings(url, MODEL, ignore_eos=True)
    async with make_client(30) as client:
        result = await send_request(client, settings, BenchRequest([5, 6, 7], 3, 6))
    assert result.is_success, result.error
    assert (result.prompt_len, result.output_len) == (3, 6)
    # Two chunks read together have a gap of 0 (a loaded machine); per chunk is what is checked.
    assert len(result.itl_s) == 5 and all(gap >= 0 for gap in result.itl_s) and sum(result.itl_s) > 0
    assert 0 < result.ttft_s <= result.e2el_s
    assert result.tpot_s is not None and result.tpot_s > 0
    body = state.bodies[-1]
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 6 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_chat_stream_skips_the_role_chunk(fake):
    url, state = fake
    settings = RequestSettings(url, MODEL, endpoint_type="chat")
    async with make_client(30) as client:
        result = await send_request(client, settings, BenchRequest("hello", 1, 3))
    assert result.is_success and result.output_len == 3 and len(result.itl_s) == 2
    assert state.bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]
    assert "ignore_eos" not in state.bodies[-1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_non_streamed_request_is_timed_whole_and_counted_from_its_usage(fake, endpoint):
    url, state = fake
    settings = RequestSettings(url, MODEL, endpoint_type=endpoint, stream=False)
    async with make_client(30) as client:
        result = await send_request(client, settings, BenchRequest("hello", 1, 5))
        failed = await send_request(client, settings, BenchRequest("fail", 1, 5))
    assert result.is_success, result.error
    assert (result.prompt_len, result.output_len) == (7, 5)
    assert result.ttft_s == result.e2el_s > 0 and result.itl_s == []
    assert state.bodies[-2]["stream"] is False and "stream_options" not in state.bodies[-2]
    assert not failed.is_success and failed.error == "HTTP 400: no such thing"


async def test_error_response_is_a_failed_result_with_the_message(fake):
    url, _ = fake
    async with make_client(30) as client:
        result = await send_request(client, RequestSettings(url, MODEL), BenchRequest("fail", 1, 3))
    assert not result.is_success
    assert result.error == "HTTP 400: no such thing"


@pytest.mark.parametrize(
    ("prompt", "error"), [("midfail", "stream error: {'message': 'engine died'"), ("cut", "without [DONE]")]
)
async def test_broken_streams_are_failures(fake, prompt, error):
    url, _ = fake
    async with make_client(30) as client:
        result = await send_request(client, RequestSettings(url, MODEL), BenchRequest(prompt, 1, 4))
    assert not result.is_success and error in result.error


async def test_run_with_progress_bar(fake):
    url, _ = fake
    run = RunSettings(50.0, show_progress=True)
    async with make_client(30) as client:
        outcome = await run_once(client, RequestSettings(url, MODEL), run, [BenchRequest([1], 1, 2)] * 3)
    assert outcome.summary["completed"] == 3


async def test_run_respects_max_concurrency_and_counts_preemptions(fake):
    url, state = fake
    requests = [BenchRequest([1, 2], 2, 4) for _ in range(12)] + [BenchRequest("fail", 1, 1)]
    run = RunSettings(math.inf, max_concurrency=3, metrics_url=url + "/metrics", show_progress=False)
    async with make_client(30) as client:
        outcome = await run_once(client, RequestSettings(url, MODEL), run, requests)
    s = outcome.summary
    assert (s["completed"], s["failed"]) == (12, 1)
    assert 1 <= state.max_in_flight <= 3
    assert s["num_preemptions"] == 12  # the fake counts one "preemption" per finished stream
    assert s["total_output_tokens"] == 48 and s["output_throughput"] > 0
    assert s["errors"] == {"HTTP 400: no such thing": 1}


async def test_unlimited_concurrency_sends_everything_at_once(fake):
    url, state = fake
    state.token_delay_s = 0.02  # long enough that all 8 streams overlap
    run = RunSettings(math.inf, show_progress=False)
    async with make_client(30) as client:
        outcome = await run_once(client, RequestSettings(url, MODEL), run, [BenchRequest([1], 1, 20)] * 8)
    assert outcome.summary["completed"] == 8
    assert state.max_in_flight == 8
    assert outcome.summary["num_preemptions"] is None  # no metrics URL given


def test_run_async_runs_the_load_generator_on_uvloop(fake):
    url, _ = fake

    async def one() -> tuple[str, bool]:
        async with make_client(30) as client:
            result = await send_request(client, RequestSettings(url, MODEL), BenchRequest([1, 2], 2, 3))
        return type(asyncio.get_running_loop()).__module__, result.is_success

    loop_module, is_success = run_async(one())
    assert loop_module.startswith("uvloop") and is_success  # the bench extra installs uvloop


def test_cli_sweep_writes_results_and_plot(fake, tmp_path):
    url, state = fake
    result_file, plot = tmp_path / "r.json", tmp_path / "sweep.png"
    argv = ["bench", "--base-url", url, "--num-prompts", "6", "--random-input-len", "8"]
    argv += ["--random-output-len", "4", "--request-rate", "200,inf", "--ignore-eos", "--no-progress"]
    argv += ["--result-file", str(result_file), "--plot", str(plot)]
    assert corral_main(argv) == 0
    doc = json.loads(result_file.read_text())
    assert doc["benchmark"]["model"] == MODEL  # taken from /v1/models
    assert [run["request_rate"] for run in doc["runs"]] == [200.0, "inf"]
    for run in doc["runs"]:
        assert (run["completed"], run["failed"], run["total_output_tokens"]) == (6, 0, 24)
        assert run["total_input_tokens"] == 48
        for key in ("mean_ttft_ms", "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "request_throughput"):
            assert run[key] > 0
        assert run["num_preemptions"] == 6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prompts = [tuple(body["prompt"]) for body in state.bodies]
    assert len(prompts) == 12 and len(set(prompts)) == 12  # each run of the sweep has fresh prompts


def test_cli_warmup_requests_go_first_and_count_in_no_figure(fake, tmp_path):
    url, state = fake
    result_file = tmp_path / "r.json"
    argv = ["bench", "--base-url", url, "--num-prompts", "6", "--random-input-len", "8"]
    argv += ["--random-output-len", "4", "--request-rate", "200,inf", "--ignore-eos", "--no-progress"]
    argv += ["--warmup-requests", "3", "--result-file", str(result_file)]
    assert corral_main(argv) == 0
    doc = json.loads(result_file.read_text())
    assert doc["benchmark"]["warmup_requests"] == 3 and doc["benchmark"]["num_prompts"] == 6
    for run in doc["runs"]:  # the fake server counts a preemption a request
        assert (run["completed"], run["failed"], run["total_output_tokens"]) == (6, 0, 24)
        assert (run["num_prompts"], run["total_input_tokens"], run["num_preemptions"]) == (6, 48, 6)
    prompts = [tuple(body["prompt"]) for body in state.bodies]
    assert len(prompts) == 15 and len(set(prompts)) == 15  # the warm-up's prompts are no run's


def test_cli_no_stream_run_counts_tokens_from_each_response(fake, tmp_path):
    url, state = fake
    result_file = tmp_path / "r.json"
    argv = ["bench", "--base-url", url, "--num-prompts", "5", "--random-input-len", "8", "--no-stream"]
    argv += ["--random-output-len", "4", "--ignore-eos", "--no-progress", "--result-file", str(result_file)]
    assert corral_main(argv) == 0
    doc = json.loads(result_file.read_text())
    assert doc["benchmark"]["stream"] is False
    (run,) = doc["runs"]
    assert (run["completed"], run["failed"], run["total_output_tokens"]) == (5, 0, 20)
    assert run["mean_ttft_ms"] == pytest.approx(run["mean_e2el_ms"])
    assert all(body["stream"] is False for body in state.bodies)


def test_cli_single_run_plots_latency_distributions(fake, tmp_path):
    url, state = fake
    plot = tmp_path / "dist.png"
    argv = ["bench", "--base-url", url, "--model", MODEL, "--num-prompts", "12", "--random-input-len", "4"]
    argv += ["--random-output-len", "4", "--no-progress", "--plot", str(plot), "--endpoint-type", "chat"]
    argv += [
        "--random-dist",
        "lognormal",
        "--random-sigma",
        "2",
        "--random-min-len",
        "2",
        "--max-output-len",
        "6",
    ]
    argv += ["--result-file", str(tmp_path / "run.json")]
    assert corral_main(argv) == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    (summary,) = json.loads((tmp_path / "run.json").read_text())["runs"]
    assert 0 < summary["client_cpu_s"] < 60  # the load generator's own CPU over the run
    max_tokens = [body["max_tokens"] for body in state.bodies]
    assert min(max_tokens) == 2 and max(max_tokens) == 6  # sigma 2 reaches both clips


def test_cli_all_failed_exits_nonzero(fake, caplog):
    url, _ = fake
    argv = ["bench", "--base-url", url, "--model", "wrong", "--num-prompts", "2", "--no-progress"]
    with caplog.at_level(logging.ERROR):
        assert corral_main(argv) == 1
    assert "every request failed" in caplog.text and "no such thing" in caplog.text


def test_cli_unreachable_endpoint_is_a_clear_error(caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.ERROR):
        assert corral_main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--no-progress"]) == 1
    assert f"cannot reach http://127.0.0.1:{port}" in caplog.text


def test_cli_rejects_bad_arguments(caplog, tmp_path):
    with caplog.at_level(logging.ERROR):
        assert corral_main(["bench", "--request-rate", "fast"]) == 1
        assert corral_main(["bench", "--dataset", str(tmp_path / "nope.json")]) == 1
        assert corral_main(["bench", "--no-stream", "--max-tokens-cap", "8"]) == 1
    assert "'fast'" in caplog.text and "cannot read dataset" in caplog.text
    assert "cannot go with --no-stream" in caplog.text


async def _raw_sse_server(pieces: list[bytes], gap_s: float):
    """An HTTP server on 127.0.0.1 answering any request with an SSE body sent as `pieces`, one
    write each, `gap_s` apart: event boundaries fall wherever the test puts them."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(gap_s)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_events_are_parsed_across_and_within_reads():
    """Several events in one read share its arrival time; an event cut mid-line (and mid-character)
    is read once whole; CRLF line ends are accepted, as SSE allows."""

    def event(text: str) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}, ensure_ascii=False).encode()

    first, second, third = event(" a") + b"\n\n", event(" b") + b"\r\n\r\n", event(" é") + b"\n\n"
    cut = third.index("é".encode()) + 1  # inside the two bytes of "é"
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
    pieces = [first + second, third[:cut], third[cut:] + event(" c") + b"\n\n" + usage, b"data: [DONE]\n\n"]
    server = await _raw_sse_server(pieces, gap_s=0.02)
    port = server.sockets[0].getsockname()[1]
    try:
        settings = RequestSettings(f"http://127.0.0.1:{port}", MODEL)
        async with make_client(30) as client:
            result = await send_request(client, settings, BenchRequest([1, 2, 3], 3, 4))
    finally:
        server.close()
        await server.wait_closed()
    assert result.is_success, result.error
    assert (result.prompt_len, result.output_len) == (3, 4)
    # Four text chunks: " b" came in the read of " a" (no gap); " é" completed two reads later,
    # in the read that also brought " c".
    assert len(result.itl_s) == 3
    assert result.itl_s[0] == 0 and result.itl_s[2] == 0
    assert result.itl_s[1] >= 0.015
