"""The proxy end to end against fake replicas (real sockets on 127.0.0.1, no engine)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from corral_gateway.app import create_app
from corral_gateway.settings import GatewaySettings

from tests.gateway.conftest import FakeEngine, serve


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connection refused


@asynccontextmanager
async def fleet(
    engines: list[FakeEngine], extra_urls: list[str] = (), **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, list[str]]]:
    async with AsyncExitStack() as stack:
        urls = [(await stack.enter_async_context(serve(e.app())))[0] for e in engines] + list(extra_urls)
        gw_settings = GatewaySettings(backends={"m": urls}, poll_interval_s=0.02, **settings)
        gw_url, _ = await stack.enter_async_context(serve(create_app(gw_settings)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=gw_url, timeout=10))
        yield client, urls


async def replicas(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    data = (await client.get("/corral/replicas")).json()["models"]["m"]
    return {r["url"]: r for r in data}


async def eventually(predicate: Any, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_forwards_original_bytes_and_passes_answer_through() -> None:
    engine = FakeEngine()
    async with fleet([engine]) as (client, _):
        raw = b'{"model": "m",   "prompt": "hi", "extra_field": [1, 2]}'
        response = await client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200 and response.json()["usage"]["total_tokens"] == 8
        # Passed on whole, with the length the replica gave it.
        assert response.headers["content-length"] == str(len(response.content))
        assert "transfer-encoding" not in response.headers
        assert engine.bodies == [raw]
        assert response.headers["x-request-id"] == engine.headers_seen[0]["x-request-id"]
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        assert (await client.get("/health")).status_code == 200


async def test_unknown_model_and_unknown_route_are_openai_404s() -> None:
    async with fleet([FakeEngine()]) as (client, _):
        response = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert response.status_code == 404
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "model_not_found"
        assert (await client.get("/v2/whatever")).json()["error"]["code"] == "not_found"
        wrong_method = await client.get("/v1/completions")
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "http_405"


async def test_malformed_body_gets_the_engines_own_error() -> None:
    engine = FakeEngine()
    async with fleet([engine]) as (client, _):
        response = await client.post("/v1/completions", content=b"{not json")
        assert response.status_code == 400 and response.json()["error"]["message"] == "bad json"
        assert (await client.get("/health")).status_code == 200


async def test_streams_sse_bytes_untouched() -> None:
    engine = FakeEngine(num_chunks=4)
    async with fleet([engine]) as (client, _):
        async with client.stream(
            "POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            body = b"".join([chunk async for chunk in r.aiter_raw()])
        expected = b"".join(f'data: {{"i": {i}, "served_by": "fake"}}\n\n'.encode() for i in range(4))
        assert body == expected + b"data: [DONE]\n\n"
        # Its first bytes told the replica's record that its prompt is computed, once; so does a
        # whole body (prefix affinity's prefill ledger counts them).
        assert (await replicas(client)).popitem()[1]["num_first_bytes"] == 1
        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert (await replicas(client)).popitem()[1]["num_first_bytes"] == 2


async def test_a_streams_chunk_times_give_its_replicas_step_interval_and_a_whole_body_does_not() -> None:
    engine = FakeEngine(num_chunks=6, chunk_delay_s=0.02)  # a step every 20 ms or so
    async with fleet([engine]) as (client, _):
        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        seen = (await replicas(client)).popitem()[1]
        assert seen["step_interval_s"] is None and seen["step_time_left_s"] is None
        async with client.stream(
            "POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        ) as r:
            _ = [chunk async for chunk in r.aiter_raw()]
        assert (await replicas(client)).popitem()[1]["step_interval_s"] > 0.0


async def test_5xx_before_first_byte_is_retried_on_another_replica() -> None:
    bad, good = FakeEngine(name="bad", mode="error500"), FakeEngine(name="good")
    async with fleet([bad, good], policy="round-robin") as (client, _):
        for _ in range(4):
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert response.status_code == 200 and response.json()["served_by"] == "good"
        assert len(bad.bodies) >= 1
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_retries_total{model="m",reason="http_500"}' in metrics


async def test_dead_replica_is_retried_ejected_and_readmitted_when_healthy() -> None:
    good = FakeEngine(name="good")
    dead = dead_url()
    async with fleet([good], extra_urls=[dead], policy="round-robin", ejection_s=0.2) as (client, _):
        for _ in range(6):
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert response.status_code == 200 and response.json()["served_by"] == "good"

        async def is_ejected() -> bool:
            return not (await replicas(client))[dead]["healthy"]

        await eventually(is_ejected)
        metrics = (await client.get("/metrics")).text
        assert f'corral_gateway_ejections_total{{replica="{dead}"}} 1.0' in metrics
        # Bring a replica up on the dead port: the /health probe re-admits it.
        port = int(dead.rsplit(":", 1)[1])
        revived = FakeEngine(name="revived")
        import uvicorn

        server = uvicorn.Server(
            uvicorn.Config(revived.app(), host="127.0.0.1", port=port, log_level="critical")
        )
        task = asyncio.create_task(server.serve())
        try:

            async def is_back() -> bool:
                return bool((await replicas(client))[dead]["healthy"])

            await eventually(is_back)
            served = {
                (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).json()["served_by"]
                for _ in range(4)
            }
            assert served == {"good", "revived"}
        finally:
            server.should_exit = True
            await task


async def test_every_replica_unreachable_is_a_503_to_retry_later() -> None:
    """Nothing was served and a retry is safe: 503 with Retry-After, which clients read as "try
    later" (it was a 502)."""
    async with fleet([], extra_urls=[dead_url(), dead_url()]) as (client, _):
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "model_unavailable"
        assert error["message"] == "No replica of model `m` could answer the request; retry later."


async def test_a_long_non_streamed_answer_waits_response_timeout_not_first_byte_timeout() -> None:
    """A non-streamed answer comes whole once generated. first_byte_timeout_s, a stream's wait for
    its first event, used to cut it with a 504, and count that towards ejecting the replica."""
    engine = FakeEngine(answer_delay_s=0.6)
    async with fleet([engine], first_byte_timeout_s=0.2) as (client, _):
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 200
        async with client.stream(
            "POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        ) as r:
            assert r.status_code == 504  # a stream's first byte is still bounded
    async with fleet([engine], response_timeout_s=0.2) as (client, _):
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 504 and response.json()["error"]["code"] == "response_timeout"
        # Slow is not broken: the replica's record shows no failure (a stopped replica is still
        # ejected by its unanswered health polls).
        (seen,) = (await replicas(client)).values()
        assert seen["num_consecutive_failures"] == 0 and seen["healthy"]


async def stream_body(client: httpx.AsyncClient) -> bytes:
    async with client.stream(
        "POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        return b"".join([chunk async for chunk in r.aiter_raw()])


def error_code_then_done(body: bytes) -> str:
    """The code of the error event a stream ends with, checking `[DONE]` follows it as its last event
    (clients read until `[DONE]`)."""
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", body
    return str(json.loads(events[-3].removeprefix("data: "))["error"]["code"])


async def test_replica_dying_mid_stream_ends_with_an_error_event_then_done() -> None:
    engine = FakeEngine(mode="die_midstream", num_chunks=5)
    async with fleet([engine]) as (client, _):
        body = await stream_body(client)
        assert body.startswith(b'data: {"i": 0, "served_by": "fake"}\n\n')
        assert error_code_then_done(body) == "upstream_disconnected"
        assert body.count(b"[DONE]") == 1
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 1.0' in metrics
        assert 'status="broken"' in metrics


async def test_a_stream_whose_replica_dies_before_its_first_event_is_retried_elsewhere() -> None:
    """An engine sends an event stream's head at once and its first event with the first tokens;
    a replica dying between the two (the request in its queue or prefill) has sent the client
    nothing, so the request goes to another replica instead of ending in an error event."""
    dying, good = FakeEngine(name="dying", mode="die_before_first_event"), FakeEngine(name="good")
    async with fleet([dying, good], policy="round-robin") as (client, _):
        for _ in range(4):
            body = await stream_body(client)
            assert body.startswith(b'data: {"i": 0, "served_by": "good"}') and b"error" not in body
        assert dying.num_active == 0 and len(dying.bodies) >= 1
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_retries_total{model="m",reason="transport_error"}' in metrics
        assert 'corral_gateway_streams_broken_total{model="m"} 0.0' in metrics


async def test_a_client_hanging_up_before_a_streams_first_event_closes_the_upstream_request() -> None:
    engine = FakeEngine(first_event_delay_s=60)
    async with fleet([engine]) as (client, _):
        body = {"model": "m", "prompt": "x", "stream": True}
        task = asyncio.create_task(client.post("/v1/completions", json=body))

        async def is_active() -> bool:
            return engine.num_active == 1

        await eventually(is_active)
        task.cancel()

        async def upstream_closed() -> bool:
            return engine.num_active == 0 and engine.num_cancelled == 1

        await eventually(upstream_closed)
        assert (await replicas(client)).popitem()[1]["num_inflight"] == 0
        assert (
            'corral_gateway_requests_total{model="m",replica="",status="499"} 1.0'
            in (await client.get("/metrics")).text
        )


async def test_a_stream_whose_only_replica_dies_before_its_first_event_is_a_503_to_retry() -> None:
    # Nothing reached the client: tried there again while attempts remain, then, as when no
    # replica is reachable, a 503 with Retry-After.
    engine = FakeEngine(mode="die_before_first_event")
    async with fleet([engine]) as (client, _):
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_unavailable"
        assert response.headers["retry-after"] == "2"
        assert len(engine.bodies) == 3 and engine.num_active == 0


async def test_replica_dying_within_an_event_ends_that_event_before_the_error() -> None:
    engine = FakeEngine(mode="die_mid_event", num_chunks=5)
    async with fleet([engine]) as (client, _):
        body = await stream_body(client)
        cut = b'data: {"i": 1'  # the event the replica died in, ended so the error event stands alone
        assert body.startswith(b'data: {"i": 0, "served_by": "fake"}\n\n' + cut + b"\n\ndata: {")
        assert error_code_then_done(body) == "upstream_disconnected"


async def test_replica_stalling_mid_stream_ends_with_a_timeout_event_then_done() -> None:
    engine = FakeEngine(mode="hang", num_chunks=3)
    async with fleet([engine], first_byte_timeout_s=0.3) as (client, _):
        body = await stream_body(client)
        assert body.startswith(b'data: {"i": 0, "served_by": "fake"}\n\n')
        assert error_code_then_done(body) == "upstream_timeout"
        await eventually(lambda: _is_zero(engine.num_active))  # the stalled request was closed


async def _is_zero(value: int) -> bool:
    return value == 0


async def test_a_stream_that_had_sent_done_gets_no_error_event() -> None:
    engine = FakeEngine(mode="die_after_done", num_chunks=2)
    async with fleet([engine]) as (client, _):
        body = await stream_body(client)
        assert body.endswith(b'"served_by": "fake"}\n\ndata: [DONE]\n\n') and b"error" not in body
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 0.0' in metrics


async def test_a_body_of_no_declared_length_cut_off_breaks_the_clients_connection() -> None:
    # Not a complete-looking 200 with half a JSON document: the client's read fails.
    engine = FakeEngine(mode="cut_chunked")
    async with fleet([engine]) as (client, _):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 1.0' in metrics


async def test_replica_dying_while_sending_a_whole_body_is_a_502() -> None:
    engine = FakeEngine(mode="cut_body")
    async with fleet([engine]) as (client, _):
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "bad_gateway"
        assert response.headers["x-request-id"] == engine.headers_seen[0]["x-request-id"]
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_streams_broken_total{model="m"} 1.0' in metrics
        assert (await client.get("/health")).status_code == 200


async def test_client_hang_up_closes_the_upstream_request() -> None:
    engine = FakeEngine(mode="hang", num_chunks=2)
    async with fleet([engine]) as (client, _):
        # Streaming: hang up after the first event.
        async with client.stream(
            "POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        ) as r:
            async for _ in r.aiter_raw():
                break

        async def upstream_closed() -> bool:
            return engine.num_active == 0 and engine.num_cancelled == 1

        await eventually(upstream_closed)
        # Non-streaming: hang up while the replica is still working.
        task = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))

        async def is_active() -> bool:
            return engine.num_active == 1

        await eventually(is_active)
        task.cancel()

        async def cancelled_twice() -> bool:
            return engine.num_active == 0 and engine.num_cancelled == 2

        await eventually(cancelled_twice)
        inflight = (await replicas(client)).popitem()[1]["num_inflight"]
        assert inflight == 0


async def test_saturated_fleet_queues_then_sheds_with_429() -> None:
    engine = FakeEngine(num_waiting=10)  # reports a long queue: saturated
    async with fleet([engine], max_queue_len=1, queue_timeout_s=10) as (client, _):

        async def is_saturated_known() -> bool:
            return (await replicas(client))[next(iter(await replicas(client)))]["num_waiting"] >= 10

        await eventually(is_saturated_known)
        queued = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
        await eventually(lambda: _queue_has(client, 1))
        shed = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == "queue_full"
        engine.num_waiting = 0  # load drops: the queued request goes through
        response = await queued
        assert response.status_code == 200


async def _queue_has(client: httpx.AsyncClient, n: int) -> bool:
    return f'corral_gateway_queue_length{{model="m"}} {float(n)}' in (await client.get("/metrics")).text


async def test_api_keys_401_429_and_valid(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-good\n    requests_per_minute: 2\n")
    engine = FakeEngine()
    async with fleet([engine], api_keys_file=keys) as (client, _):
        body = {"model": "m", "prompt": "x"}
        assert (await client.post("/v1/completions", json=body)).status_code == 401
        wrong = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer sk-bad"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": "Bearer sk-good"}
        assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 200
        assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 200
        limited = await client.post("/v1/completions", json=body, headers=auth)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert (await client.get("/v1/models")).status_code == 401
        # The client's key is never forwarded to the engine, nor shown in metrics.
        assert all("authorization" not in h for h in engine.headers_seen)
        assert "sk-good" not in (await client.get("/metrics")).text


async def test_a_request_that_is_not_served_costs_no_tokens(tmp_path: Path) -> None:
    """A token-limited key is charged its request's estimate up front; an error answer (the
    engine's, such as a prompt over the context length, or the gateway's own) gives it back. It
    used to stand, so a few refused requests locked the key out for a minute."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-a\n    tokens_per_minute: 1000\n")
    auth = {"authorization": "Bearer sk-a"}
    body = {"model": "m", "prompt": "x" * 2000, "max_tokens": 16}  # ~516 tokens estimated
    engine = FakeEngine(mode="error500")  # the model's only replica: its 500 is passed on
    async with fleet([engine], api_keys_file=keys) as (client, _):
        for _ in range(4):
            assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 500
        engine.mode = "ok"
        assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 200
    async with fleet([], extra_urls=[dead_url()], api_keys_file=keys) as (client, _):
        for _ in range(4):
            assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 503
        assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 503


async def test_an_embeddings_request_is_charged_its_inputs_not_output_tokens(tmp_path: Path) -> None:
    """/v1/embeddings generates nothing: a batch of 40 short inputs (50 tokens) was charged 40
    default outputs of 16 tokens too (691), over a 200-token key's whole minute, until the response's
    usage settled it (here: never, as a replica that reports none), so parallel batches got 429s."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-a\n    tokens_per_minute: 200\n")
    auth = {"authorization": "Bearer sk-a"}
    body = {"model": "m", "input": ["hello"] * 40}  # 50 tokens: four fit in the minute
    async with fleet([FakeEngine()], api_keys_file=keys) as (client, _):
        for _ in range(4):
            assert (await client.post("/v1/embeddings", json=body, headers=auth)).status_code == 200
        assert (await client.post("/v1/embeddings", json=body, headers=auth)).status_code == 429


async def _answer_to_a_partial_upload(client: httpx.AsyncClient, head: str) -> bytes:
    """The status line the gateway answers a POST with whose body has only begun to arrive (the
    rest never comes): a gateway waiting for the whole body never answers."""
    url = httpx.URL(str(client.base_url))
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(head.encode() + b"\r\n" + b"{" + b" " * 1024)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()


async def test_a_request_without_a_key_or_too_large_is_refused_before_its_body_is_read(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-good\n")
    engine = FakeEngine()
    async with fleet([engine], api_keys_file=keys, max_request_bytes=1024 * 1024) as (client, _):
        post = "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        no_key = post + "content-length: 1000000\r\n"
        assert (await _answer_to_a_partial_upload(client, no_key)).startswith(b"HTTP/1.1 401")
        too_large = post + "authorization: Bearer sk-good\r\ncontent-length: 2000000\r\n"
        assert (await _answer_to_a_partial_upload(client, too_large)).startswith(b"HTTP/1.1 413")
        # The gateway keeps serving: the next request goes through.
        body = {"model": "m", "prompt": "x"}
        auth = {"authorization": "Bearer sk-good"}
        assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 200
        assert len(engine.bodies) == 1  # only the last one reached a replica


async def test_browsers_may_call_it_and_preflights_need_no_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-good\n")
    async with fleet([FakeEngine()], api_keys_file=keys) as (client, _):
        origin = {"origin": "http://127.0.0.1:3000"}
        preflight = {
            **origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization",
        }
        r = await client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        body = {"model": "m", "prompt": "x"}
        r = await client.post(
            "/v1/completions", json=body, headers={**origin, "authorization": "Bearer sk-good"}
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = await client.post("/v1/completions", json=body, headers=origin)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        assert (await client.head("/health")).status_code == 200


async def test_load_headers_and_metrics_polls_feed_the_registry() -> None:
    engine = FakeEngine(num_running=3, num_waiting=1, kv_usage=0.5)  # like vLLM: no load headers on /health
    async with fleet([engine]) as (client, urls):

        async def has_load() -> bool:
            r = (await replicas(client))[urls[0]]
            return bool(r["load_fresh"] and r["num_running"] >= 3 and r["kv_usage_ratio"] == 0.5)

        await eventually(has_load)
        assert engine.num_metrics_scrapes > 0
        metrics = (await client.get("/metrics")).text
        assert "corral_gateway_replica_score" in metrics and "corral_gateway_replica_healthy" in metrics


async def test_replicas_with_load_headers_are_polled_without_scraping_metrics() -> None:
    corral_like = FakeEngine(num_running=2, num_waiting=7, kv_usage=0.25, health_has_load=True)
    vllm_like = FakeEngine(num_running=1, num_waiting=0, kv_usage=0.5)
    async with fleet([corral_like, vllm_like]) as (client, urls):

        async def both_known() -> bool:
            seen = await replicas(client)
            return bool(
                seen[urls[0]]["load_fresh"]
                and seen[urls[0]]["num_waiting"] == 7
                and seen[urls[1]]["load_fresh"]
                and seen[urls[1]]["kv_usage_ratio"] == 0.5
            )

        await eventually(both_known)
        corral_like.num_waiting = 0  # and later samples keep coming the cheap way
        await eventually(lambda: _waiting_is(client, urls[0], 0))
        assert corral_like.num_metrics_scrapes == 0
        assert vllm_like.num_metrics_scrapes > 1


async def _waiting_is(client: httpx.AsyncClient, url: str, n: int) -> bool:
    return bool((await replicas(client))[url]["num_waiting"] == n)


def test_settings_defaults_are_sane() -> None:
    settings = GatewaySettings()
    assert settings.policy == "prefix-affinity"
    assert 0.05 <= settings.poll_interval_s <= 0.1 and settings.load_max_age_s == 2.0


async def test_an_unexpected_bug_still_answers_openai_shaped_500(monkeypatch: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr("corral_gateway.proxy.peek_request", broken)
    async with fleet([FakeEngine()]) as (client, _):
        headers = {"x-request-id": "client-9"}
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)
        assert response.status_code == 500 and response.json()["error"]["type"] == "internal_error"
        assert response.headers["x-request-id"] == "client-9"
        assert (await client.get("/health")).status_code == 200


async def test_not_ready_until_kubernetes_discovery_has_listed(tmp_path: Path) -> None:
    unreachable = {"enabled": True, "kubeconfig": str(tmp_path / "missing-kubeconfig")}
    settings = GatewaySettings(kubernetes=unreachable)
    async with serve(create_app(settings)) as (url, _), httpx.AsyncClient(base_url=url, timeout=10) as client:
        assert (await client.get("/health")).status_code == 200  # alive...
        response = await client.get("/ready")  # ...but not ready: every model would look unknown
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "not_ready"
    async with fleet([FakeEngine()]) as (client, _):
        assert (await client.get("/ready")).json() == {"status": "ready", "models": ["m"]}


async def test_pass_through_ends_the_exchange_even_if_the_body_never_started() -> None:
    from corral_gateway.passthrough import PassThrough

    ended: list[bool] = []
    started: list[bool] = []

    async def body() -> Any:
        started.append(True)
        yield b"data: x\n\n"

    async def failing_send(message: Any) -> None:
        raise OSError("client gone")

    async def receive_nothing() -> Any:
        raise AssertionError("not read")

    disconnect: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    response = PassThrough(body(), disconnect, lambda: ended.append(True), lambda: False, 200, {})
    with pytest.raises(OSError):
        await response({"type": "http"}, receive_nothing, failing_send)
    assert ended == [True] and not started and disconnect.cancelled()
