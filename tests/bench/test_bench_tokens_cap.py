"""`corral bench --max-tokens-cap`: the server sees only the cap; the client ends each stream itself."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from corral_cli.bench.client import RequestSettings, carries_token, send_request
from corral_cli.bench.runner import make_client
from corral_cli.bench.workload import BenchRequest
from corral_cli.main import main as corral_main

from .fake_openai import MODEL, FakeState, serve_fake

CAP = 400


@pytest.fixture
def fake():
    # A full capped stream would take CAP x 5 ms = 2 s; a client that stops early ends it sooner.
    with serve_fake(FakeState(token_delay_s=0.005)) as (url, state):
        yield url, state


async def _stream_ends(state: FakeState, count: int) -> list[int]:
    """The server's per-stream token counts once `count` streams have ended (closed or finished)."""
    deadline = time.monotonic() + 10
    while len(state.num_tokens_sent) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return state.num_tokens_sent


async def test_capped_request_sends_the_cap_and_stops_after_the_sampled_length(fake):
    url, state = fake
    settings = RequestSettings(url, MODEL, ignore_eos=True, max_tokens_cap=CAP)
    async with make_client(30) as client:
        result = await send_request(client, settings, BenchRequest([5, 6, 7], 3, 5))
    assert result.is_success, result.error
    assert (result.prompt_len, result.output_len) == (3, 5)  # the sampled length is the output
    assert len(result.itl_s) == 4 and 0 < result.ttft_s <= result.e2el_s
    assert state.bodies[-1]["max_tokens"] == CAP  # the server never learns the real length
    (num_sent,) = await _stream_ends(state, 1)
    assert 5 <= num_sent < CAP  # the client closed the stream; the server stopped generating


async def test_capped_chat_does_not_count_the_role_chunk(fake):
    url, state = fake
    settings = RequestSettings(url, MODEL, endpoint_type="chat", max_tokens_cap=CAP)
    async with make_client(30) as client:
        result = await send_request(client, settings, BenchRequest("hello", 1, 4))
    assert result.is_success and result.output_len == 4 and len(result.itl_s) == 3
    assert state.bodies[-1]["max_tokens"] == CAP
    (num_sent,) = await _stream_ends(state, 1)
    assert 4 <= num_sent < CAP


async def test_sampled_length_over_the_cap_stops_at_the_cap(fake):
    url, state = fake
    settings = RequestSettings(url, MODEL, max_tokens_cap=3)
    async with make_client(30) as client:
        result = await send_request(client, settings, BenchRequest([1, 2], 2, 8))
    assert result.is_success and result.output_len == 3  # the server's usage: it finished at the cap
    assert state.bodies[-1]["max_tokens"] == 3


async def test_uncapped_request_reads_to_the_end(fake):
    url, state = fake
    async with make_client(30) as client:
        result = await send_request(client, RequestSettings(url, MODEL), BenchRequest([1], 1, 6))
    assert result.is_success and result.output_len == 6
    assert state.bodies[-1]["max_tokens"] == 6
    assert await _stream_ends(state, 1) == [6]


async def test_capped_request_counts_multi_token_chunks_from_the_running_usage():
    # A server that merges tokens for a slow reader: chunks of 3 tokens, usage so far on each.
    with serve_fake(FakeState(token_delay_s=0.005, tokens_per_chunk=3)) as (url, state):
        settings = RequestSettings(url, MODEL, ignore_eos=True, max_tokens_cap=CAP)
        async with make_client(30) as client:
            result = await send_request(client, settings, BenchRequest([5, 6, 7], 3, 5))
        assert state.bodies[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert result.is_success and result.output_len == 6  # two chunks of 3: what arrived
        (num_sent,) = await _stream_ends(state, 1)
        assert 6 <= num_sent < CAP


def test_tokens_are_chunks_with_a_token_not_role_or_finish_chunks():
    def completion(text: str, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    assert carries_token(completion(" a"), "completions")
    assert carries_token(completion(""), "completions")  # a token that decodes to no text yet
    assert not carries_token(completion("", "length"), "completions")
    assert not carries_token({"choices": [], "usage": {"completion_tokens": 3}}, "completions")
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert not carries_token(role, "chat")
    assert carries_token({"choices": [{"index": 0, "delta": {"content": "x"}}]}, "chat")


def test_cli_max_tokens_cap(fake, tmp_path, capsys):
    url, state = fake
    result_file = tmp_path / "r.json"
    argv = ["bench", "--base-url", url, "--num-prompts", "4", "--random-input-len", "8"]
    argv += ["--random-output-len", "3", "--ignore-eos", "--no-progress", "--max-tokens-cap", str(CAP)]
    assert corral_main([*argv, "--result-file", str(result_file)]) == 0
    doc = json.loads(result_file.read_text())
    assert doc["benchmark"]["max_tokens_cap"] == CAP
    (run,) = doc["runs"]
    assert (run["completed"], run["total_output_tokens"]) == (4, 12)
    assert [body["max_tokens"] for body in state.bodies] == [CAP] * 4
    with pytest.raises(SystemExit):
        corral_main([*argv[:-1], "0"])
    assert "argument --max-tokens-cap: expected an integer >= 1" in capsys.readouterr().err
