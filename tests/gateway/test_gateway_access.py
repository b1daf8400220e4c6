"""The gateway's request id, access log line and per-API-key token counters (fake replicas on
127.0.0.1): one line per request however it ends, keys by name, never the key or the prompt."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from corral_engine import wire
from corral_gateway.body_reader import BodyReader, ReportedUsage

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import fleet

ACCESS_LOGGER = "corral_gateway.access"


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.__dict__ for r in caplog.records if r.name == ACCESS_LOGGER]


async def test_one_access_line_per_request_with_the_id_sent_upstream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    engine = FakeEngine()
    async with fleet([engine]) as (client, urls):
        body = {"model": "m", "prompt": "a private prompt"}
        ok = await client.post("/v1/completions", json=body, headers={"x-request-id": "client-7"})
        missing = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert ok.headers[wire.HEADER_REQUEST_ID] == "client-7"
    assert engine.headers_seen[0][wire.HEADER_REQUEST_ID] == "client-7"
    first, second = access_lines(caplog)
    assert {k: first[k] for k in ("request_id", "model", "replica", "status")} == {
        "request_id": "client-7",
        "model": "m",
        "replica": urls[0],
        "status": "200",
    }
    assert (first["prompt_tokens"], first["completion_tokens"]) == (3, 5)
    assert isinstance(first["latency_s"], float) and first["latency_s"] >= 0
    assert second["request_id"] == missing.headers[wire.HEADER_REQUEST_ID]
    assert (second["status"], second["replica"]) == ("404", "")
    assert "a private prompt" not in caplog.text


@pytest.mark.parametrize("mode", ["error500", "cut_body"])
async def test_a_replica_failure_is_logged_with_the_request_id_as_a_field(
    caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """A JSON log pipeline joins a request's lines on the `request_id` field, not on the text."""
    caplog.set_level(logging.WARNING, "corral_gateway")
    engines = [FakeEngine(name="bad", mode=mode), FakeEngine(name="good")]
    async with fleet(engines, policy="round-robin") as (client, _):
        for i in range(2):  # round-robin: one of them tries the failing replica first
            await client.post(
                "/v1/completions", json={"model": "m", "prompt": "x"}, headers={"x-request-id": f"f{i}"}
            )
    failures = [r for r in caplog.records if "failed" in r.getMessage() and r.name != ACCESS_LOGGER]
    assert failures
    for record in failures:
        assert record.__dict__.get("request_id") in ("f0", "f1"), record.getMessage()
        assert record.__dict__["request_id"] in record.getMessage()


async def test_the_access_line_says_why_a_response_that_began_ended_early(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    stream = {"model": "m", "prompt": "x", "stream": True}
    async with fleet([FakeEngine(mode="die_midstream")]) as (client, _):
        await client.post("/v1/completions", json=stream)
        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    ended = [(line["status"], line["ended"]) for line in access_lines(caplog)]
    assert ended == [("broken", "replica_failed"), ("200", None)]


async def test_invalid_incoming_id_is_replaced_before_it_reaches_engine_or_logs() -> None:
    engine = FakeEngine()
    async with fleet([engine]) as (client, _):
        r = await client.post(
            "/v1/completions", json={"model": "m", "prompt": "x"}, headers={"x-request-id": "a b"}
        )
    sent = engine.headers_seen[0][wire.HEADER_REQUEST_ID]
    assert sent != "a b" and wire.valid_request_id(sent) == sent
    assert r.headers[wire.HEADER_REQUEST_ID] == sent


async def test_every_response_carries_a_request_id() -> None:
    """The gateway's own answers too: an unknown model's 404 on /v1/models/{id}, the model list,
    health, a wrong method on a generation route, a browser's preflight; a valid client id is
    adopted there as on proxied requests."""
    async with fleet([FakeEngine()]) as (client, _):
        answers = [
            await client.get("/v1/models/nope"),
            await client.get("/v1/models"),
            await client.get("/health"),
            await client.get("/v1/completions"),
            await client.options(
                "/v1/completions",
                headers={"origin": "http://ui.example", "access-control-request-method": "POST"},
            ),
        ]
        adopted = await client.get("/v1/models/nope", headers={"x-request-id": "client-8"})
    assert [r.status_code for r in answers] == [404, 200, 200, 405, 200]
    for r in answers:
        assert wire.valid_request_id(r.headers.get(wire.HEADER_REQUEST_ID)), r.url
    assert adopted.headers[wire.HEADER_REQUEST_ID] == "client-8"


async def test_minted_request_ids_are_random() -> None:
    """The engine shows the id in the response's `id`: a minted one is 128 random bits (uuid4's
    size, as vLLM's and OpenAI's ids are random), not a process prefix and a counter that would
    tell a client how busy the gateway is and where to guess other clients' ids."""
    engine = FakeEngine()
    async with fleet([engine]) as (client, _):
        for _ in range(3):
            await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    ids = [h[wire.HEADER_REQUEST_ID] for h in engine.headers_seen]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    # Random ids share no prefix worth the name (a chance of 3 in 2^64 that they do).
    assert len({i[:16] for i in ids}) == 3


async def test_access_log_can_be_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    async with fleet([FakeEngine()], access_log=False) as (client, _):
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status_code == 200
    assert access_lines(caplog) == []


async def test_tokens_are_counted_per_key_name_never_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ACCESS_LOGGER)
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-team-secret\n    name: team-a\n")
    async with fleet([FakeEngine()], api_keys_file=keys) as (client, _):
        auth = {"authorization": "Bearer sk-team-secret"}
        for _ in range(2):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=auth)
            assert r.status_code == 200
        metrics = (await client.get("/metrics", headers=auth)).text
    assert 'corral_gateway_key_tokens_total{key="team-a",kind="prompt",model="m"} 6.0' in metrics
    assert 'corral_gateway_key_tokens_total{key="team-a",kind="completion",model="m"} 10.0' in metrics
    assert [line["key"] for line in access_lines(caplog)] == ["team-a", "team-a"]
    assert "sk-team-secret" not in metrics and "sk-team-secret" not in caplog.text


def test_usage_tail_reads_the_last_usage_of_a_stream() -> None:
    tail = BodyReader()
    assert tail.reported() is None
    tail.feed(b'data: {"usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}\n\n')
    tail.feed(b"x" * 10_000)  # only the end is kept
    tail.feed(b'data: {"usage": {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}}\n\n')
    tail.feed(b"data: [DONE]\n\n")
    assert tail.reported() == ReportedUsage(4, 9, 13)


def test_usage_tail_reads_a_responses_usage() -> None:
    """The Responses API names the counts input_tokens and output_tokens (a stream's last event,
    response.completed, carries them)."""
    tail = BodyReader()
    usage = {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    event = {"type": "response.completed", "response": {"output": [], "usage": usage}, "sequence_number": 9}
    tail.feed(b"event: response.completed\ndata: " + json.dumps(event).encode() + b"\n\n")
    assert tail.reported() == ReportedUsage(7, 3, 10)


async def test_version_route() -> None:
    from corral_cli.main import version

    async with fleet([FakeEngine()]) as (client, _):
        r = await client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": version()}
