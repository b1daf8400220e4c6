"""Acceptance 1, 3, 5: the official openai client through the gateway, hang-ups, malformed requests."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from e2e.gateway.conftest import MODEL, wait_for
from e2e.procs import EngineProcess, ManagedProcess

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "Tell me a story about a goat."}]


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_and_completions_match_a_single_engine(
    gateway: ManagedProcess, engines: list[EngineProcess]
) -> None:
    via_gw, direct = client_for(gateway.url), client_for(engines[0].url)
    for c in (via_gw, direct):
        assert [m.id for m in c.models.list().data] == [MODEL]
    kwargs = {"model": MODEL, "max_tokens": 12, "temperature": 0.0}
    chat_gw = via_gw.chat.completions.create(messages=CHAT, **kwargs)  # type: ignore[arg-type, call-overload]
    chat_direct = direct.chat.completions.create(messages=CHAT, **kwargs)  # type: ignore[arg-type, call-overload]
    assert chat_gw.choices[0].message.content == chat_direct.choices[0].message.content
    assert chat_gw.usage == chat_direct.usage and chat_gw.usage is not None
    # n and seed: sampled text is a function of the seed, whichever replica serves it.
    sampled = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 10,
        "n": 3,
        "seed": 7,
        "temperature": 1.0,
    }
    comp_gw = via_gw.completions.create(**sampled)  # type: ignore[call-overload]
    comp_direct = direct.completions.create(**sampled)  # type: ignore[call-overload]
    assert [c.text for c in comp_gw.choices] == [c.text for c in comp_direct.choices]
    assert len(comp_gw.choices) == 3 and comp_gw.usage is not None
    assert comp_gw.usage.completion_tokens == comp_direct.usage.completion_tokens  # type: ignore[union-attr]


def test_streaming_with_usage_matches(gateway: ManagedProcess, engines: list[EngineProcess]) -> None:
    texts, usages = [], []
    for url in (gateway.url, engines[1].url):
        stream = client_for(url).chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        usages.append(chunks[-1].usage)
    assert texts[0] == texts[1] and texts[0]
    assert usages[0] == usages[1] and usages[0] is not None and usages[0].completion_tokens == 16


def test_responses_whole_and_streamed_match_a_single_engine(
    gateway: ManagedProcess, engines: list[EngineProcess]
) -> None:
    """POST /v1/responses is routed by the body's model and streamed through untouched."""
    via_gw, direct = client_for(gateway.url), client_for(engines[0].url)
    kwargs = {
        "model": MODEL,
        "input": "Tell me a story.",
        "instructions": "Be brief.",
        "max_output_tokens": 8,
    }
    whole_gw = via_gw.responses.create(temperature=0.0, **kwargs)  # type: ignore[call-overload]
    whole_direct = direct.responses.create(temperature=0.0, **kwargs)  # type: ignore[call-overload]
    assert whole_gw.output_text == whole_direct.output_text and whole_gw.output_text
    usages = [
        (u.input_tokens, u.output_tokens) for u in (whole_gw.usage, whole_direct.usage) if u is not None
    ]
    assert len(usages) == 2 and usages[0] == usages[1]  # cached_tokens: whichever replica saw it first
    assert whole_gw.status == "incomplete"
    events = list(via_gw.responses.create(temperature=0.0, stream=True, **kwargs))  # type: ignore[call-overload]
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole_gw.output_text == events[-1].response.output_text


def test_unknown_model_is_404_like_the_engine(gateway: ManagedProcess, engines: list[EngineProcess]) -> None:
    errors = []
    for url in (gateway.url, engines[0].url):
        with pytest.raises(openai.NotFoundError) as info:
            client_for(url).completions.create(model="no-such-model", prompt="x", max_tokens=1)
        errors.append(info.value.body)
    assert errors[0] == errors[1]


MALFORMED: list[tuple[str, bytes]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[]"),
    ("/v1/completions", b'"just a string"'),
    ("/v1/completions", b"\xff\xfe\x00garbage"),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/v1/completions", json.dumps({"prompt": "no model"}).encode()),
    ("/v1/completions", json.dumps({"model": 42, "prompt": "x"}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "ten"}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": 1e9}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "top_p": 2}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 5000}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**9}).encode()),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode()),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hello"}).encode()),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"content": "no role"}]}).encode()),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode()),
]


def test_malformed_requests_get_the_engines_errors(
    gateway: ManagedProcess, engines: list[EngineProcess]
) -> None:
    with httpx.Client(timeout=30) as http:
        for path, raw in MALFORMED:
            headers = {"content-type": "application/json"}
            direct = http.post(engines[0].url + path, content=raw, headers=headers)
            via_gw = http.post(gateway.url + path, content=raw, headers=headers)
            assert 400 <= direct.status_code < 500, (path, raw[:60], direct.text)
            assert (via_gw.status_code, via_gw.json()) == (direct.status_code, direct.json()), raw[:60]
        assert http.get(gateway.url + "/health").status_code == 200
        ok = http.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


def _running(engines: list[EngineProcess]) -> float:
    return sum(e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting") for e in engines)


def _generated(engines: list[EngineProcess]) -> float:
    return sum(e.metric("vllm:generation_tokens_total") for e in engines)


def _aborted(engines: list[EngineProcess]) -> float:
    return sum(e.metric("vllm:request_success_total", finished_reason="abort") for e in engines)


def gateway_address(gateway: ManagedProcess) -> str:
    return urlsplit(gateway.url).netloc


def test_client_hang_up_aborts_on_the_engine(gateway: ManagedProcess, engines: list[EngineProcess]) -> None:
    """A client that goes away, streaming or not, ends its sequences on the engine by abort (not
    by length) and frees their blocks. Judged by the engines' finish reasons, not by how many
    tokens they managed meanwhile: on a Zen 5 the tiny model generated 1,773 of 4 x 480 tokens
    within a 0.3 s client timeout, and a hang-up reached it after up to ~0.25 s."""
    n = 8
    body = {"model": MODEL, "prompt": "Hang up on me", "max_tokens": 480, "n": n, "ignore_eos": True}
    full = n * 480
    for _ in range(3):  # streaming: read one event, then hang up
        before, aborted = _generated(engines), _aborted(engines)
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", gateway.url + "/v1/completions", json={**body, "stream": True}) as r,
        ):
            next(r.iter_lines())
        wait_for("engines to abort the stream", lambda: _running(engines) == 0, timeout_s=10)
        assert _aborted(engines) - aborted == n
        assert _generated(engines) - before < full
    # Non-streaming: the client goes away as soon as the engines hold the request (a raw socket,
    # closed then).
    before, aborted = _generated(engines), _aborted(engines)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {gateway_address(gateway)}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    host, port = gateway_address(gateway).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + payload)
        wait_for("the engines to hold the request", lambda: _running(engines) > 0, timeout_s=10)
    wait_for("engines to abort the request", lambda: _running(engines) == 0, timeout_s=10)
    assert _aborted(engines) - aborted == n  # every sequence ended by the abort, none ran to its length
    assert 0 < _generated(engines) - before < full
    assert all(e.metric("vllm:kv_cache_usage_perc") == 0 for e in engines)
