"""A replica answering 429 because its own waiting queue is full (`--max-waiting`, the engine's
`code`) before the first byte: the request goes to a replica with room, or waits in the gateway's
queue for one (up to its queue deadline and attempts), rather than getting that 429 at once."""

from __future__ import annotations

import asyncio

import httpx
from corral_engine import wire
from corral_engine.errors import QueueFullError
from corral_engine.server.errors import to_api_error
from corral_gateway.load import LoadSample
from corral_gateway.registry import Replica, Saturation

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import eventually, fleet

COMPLETION = {"model": "m", "prompt": "x"}


def test_the_engines_queue_full_429_carries_the_code_the_gateway_reads() -> None:
    error = to_api_error(QueueFullError("the engine's waiting queue is full (0 requests)"))
    assert error.status_code == 429 and error.code == wire.CODE_QUEUE_FULL


def test_a_refusing_replica_takes_one_request_per_place_freed_there() -> None:
    replica, saturation = Replica("m", "http://a"), Saturation()
    replica.on_dispatch()  # a request it serves
    replica.on_dispatch()  # the request it refuses, holding that one
    replica.refusal.refused(now_s=0.0, until_s=1.0, num_held=1)
    replica.on_done()  # the refused request's own lease: nothing freed
    assert replica.load(0.5, 5.0).is_saturated(saturation)
    assert replica.load(2.0, 5.0).is_saturated(saturation)  # past its Retry-After, but ours is there
    replica.on_done()  # the request served there ended: room for one
    assert not replica.load(0.5, 5.0).is_saturated(saturation)
    replica.on_dispatch()  # it takes that place: the next waits again
    assert replica.load(0.5, 5.0).is_saturated(saturation)
    replica.on_done()  # ended too: room for one again
    assert not replica.load(0.5, 5.0).is_saturated(saturation)


def test_a_poll_that_sees_only_the_place_ours_freed_lets_one_request_through() -> None:
    """A load poll landing between our request's end and the next send used to end the refusal,
    so every queued request went there and all but one got the engine's 429 again."""
    replica, saturation = Replica("m", "http://a"), Saturation()
    replica.on_dispatch()  # a request it serves
    replica.on_dispatch()  # the request it refuses, holding that one
    replica.refusal.refused(now_s=0.0, until_s=1.0, num_held=1)
    replica.on_done()  # the refused request's own lease
    replica.on_done()  # the request served there ended: room for one
    replica.observe(LoadSample(num_running=0, num_waiting=0, kv_usage_ratio=0.0, at_s=0.5))
    assert not replica.load(0.5, 5.0).is_saturated(saturation)
    replica.on_dispatch()  # it takes that place: the next waits again
    assert replica.load(0.5, 5.0).is_saturated(saturation)


def test_a_poll_that_sees_more_room_than_ours_freed_ends_the_refusal() -> None:
    replica, saturation = Replica("m", "http://a"), Saturation()
    replica.on_dispatch()
    replica.on_dispatch()
    replica.refusal.refused(now_s=0.0, until_s=1.0, num_held=2)  # ours and another gateway's
    replica.on_done()
    replica.on_done()  # ours ended: one place
    replica.observe(LoadSample(num_running=0, num_waiting=0, kv_usage_ratio=0.0, at_s=0.5))  # both gone
    replica.on_dispatch()
    replica.on_dispatch()
    assert not replica.load(0.5, 5.0).is_saturated(saturation)
    assert replica.refusal.until_s is None


def test_a_refusal_runs_out_after_its_retry_after_with_nothing_of_ours_there() -> None:
    replica, saturation = Replica("m", "http://a"), Saturation()
    replica.on_dispatch()
    replica.refusal.refused(now_s=0.0, until_s=1.0, num_held=None)
    replica.on_done()
    assert replica.load(0.5, 5.0).is_saturated(saturation)
    assert not replica.load(1.0, 5.0).is_saturated(saturation)
    replica.on_dispatch()
    replica.on_dispatch()
    assert not replica.load(1.0, 5.0).is_saturated(saturation)


async def test_a_full_replica_sends_the_request_to_one_with_room() -> None:
    full, free = FakeEngine(name="full", num_queue_full=1), FakeEngine(name="free")
    async with fleet([full, free], policy="round-robin") as (client, _):
        for _ in range(2):  # round robin: one of them goes to `full` first
            response = await client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200 and response.json()["served_by"] == "free"
        assert full.num_refused == 1
        metrics = (await client.get("/metrics")).text
        assert 'corral_gateway_retries_total{model="m",reason="http_429"} 1.0' in metrics


async def test_a_request_refused_by_the_only_replica_waits_in_the_gateways_queue_for_room() -> None:
    gate = asyncio.Event()
    engine = FakeEngine(end_gate=gate, refusal_retry_after="60")  # room comes only when one ends
    async with fleet([engine], queue_timeout_s=30) as (client, _):
        async with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as first:
            assert first.status_code == 200
            chunks = first.aiter_raw()
            await anext(chunks)
            engine.num_queue_full = 1  # the engine's queue is full now
            second = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
            await eventually(lambda: _queue_has(client, 1))  # refused once, then queued here
            assert engine.num_refused == 1 and not second.done()
            gate.set()  # the first request ends: a place frees
            assert b"".join([c async for c in chunks]).endswith(b"data: [DONE]\n\n")
        response = await asyncio.wait_for(second, 10)
        assert response.status_code == 200 and response.json()["served_by"] == "fake"
        assert engine.num_refused == 1 and len(engine.bodies) == 3


async def test_every_replica_full_waits_then_goes_where_room_came_back() -> None:
    a, b = FakeEngine(name="a", num_queue_full=1), FakeEngine(name="b", num_queue_full=1)
    async with fleet([a, b], queue_timeout_s=30) as (client, _):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 200  # the third attempt waited for a Retry-After to pass
        assert (a.num_refused, b.num_refused) == (1, 1) and len(a.bodies) + len(b.bodies) == 3


async def test_a_replica_that_stays_full_is_not_hammered_the_queue_deadline_answers() -> None:
    engine = FakeEngine(num_queue_full=100, refusal_retry_after="60")
    async with fleet([engine], queue_timeout_s=0.3) as (client, _):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 503 and response.json()["error"]["code"] == "queue_timeout"
        assert response.headers["retry-after"] == "1"
        assert engine.num_refused == 1  # then it waited in the gateway's queue, not at the replica


async def test_the_last_attempts_429_is_passed_through() -> None:
    engine = FakeEngine(num_queue_full=100, refusal_retry_after="0")  # Retry-After: 0, room at once
    async with fleet([engine], max_attempts=2) as (client, _):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 429 and response.json()["error"]["code"] == wire.CODE_QUEUE_FULL
        assert engine.num_refused == 2


async def test_a_429_that_limits_the_client_is_passed_through_not_queued() -> None:
    engine = FakeEngine(mode="reject429")  # no queue-full code: a limit another try would meet too
    async with fleet([engine], queue_timeout_s=30) as (client, _):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 429 and response.json() == {"error": {"message": "full"}}
        assert len(engine.bodies) == 1


async def _queue_has(client: httpx.AsyncClient, n: int) -> bool:
    return f'corral_gateway_queue_length{{model="m"}} {float(n)}' in (await client.get("/metrics")).text
