"""Streamed chunks encoded with their repeated fields pre-encoded equal the plain encoding (pure)."""

from __future__ import annotations

import inspect
import json

import pytest
from corral_engine.server.streaming import ChunkEncoder, sse

BASE = {"id": 'cmpl-"x"', "object": "text_completion", "created": 1_700_000_000, "model": "démo/model"}
TEXTS = ["", "hello", 'quote " and \\ slash', "line\nbreak\ttab\x00\x1f", "naïve 日本 🦙", "</script>"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_chunks_equal_the_plain_encoding(include_usage: bool, text: str) -> None:
    encoder = ChunkEncoder(BASE, include_usage)
    tail = {"usage": None} if include_usage else {}
    for finish, stop in [(None, None), ("stop", "###"), ("stop", 2), ("length", None)]:
        choices = [{"index": 3, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop}]
        assert encoder.chunk(choices) == sse({**BASE, "choices": choices, **tail})
        event = json.loads(encoder.chunk(choices)[len(b"data: ") :])
        assert event["choices"][0]["text"] == text and list(event)[:4] == list(BASE)


def test_the_usage_chunk_replaces_the_null_usage() -> None:
    encoder = ChunkEncoder(BASE, include_usage=True)
    totals = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert encoder.chunk([], usage=totals) == sse({**BASE, "choices": [], "usage": totals})
    assert encoder.chunk([], usage=None).endswith(b',"usage":null}\n\n')


def test_the_engine_app_turns_fastapi_telemetry_off_where_fastapi_has_it() -> None:
    from corral_engine.server.app import fastapi_options
    from fastapi import FastAPI

    options = fastapi_options()
    FastAPI(**options)  # accepted by the installed FastAPI
    assert bool(options) == ("telemetry" in inspect.signature(FastAPI.__init__).parameters)
    if options:
        assert options["telemetry"] == {"tracing": False, "metrics": False, "logs": False}
