"""The gateway's own overhead histogram: one observation per part and proxied request, in range, and
the time a request waits for a replica (or spends on a failed attempt) left out of its `request` part."""

from __future__ import annotations

import asyncio

import httpx
from corral_gateway.metrics import OVERHEAD_PARTS, OVERHEAD_SECONDS, QUEUE_LENGTH, QUEUE_WAIT_SECONDS
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import eventually, fleet, replicas

# Far above anything a loopback hop on an idle machine takes; the waits made on purpose are longer.
GENEROUS_S = 0.25


async def histogram(client: httpx.AsyncClient, name: str) -> dict[str, tuple[float, float]]:
    """(count, sum) of the gateway's histogram `name` for model m, by `part` (or "" without one)."""
    text = (await client.get("/metrics")).text
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.labels.get("model") != "m" or sample.name not in (f"{name}_count", f"{name}_sum"):
                continue
            count, total = out.get(sample.labels.get("part", ""), (0.0, 0.0))
            if sample.name.endswith("_count"):
                count = sample.value
            else:
                total = sample.value
            out[sample.labels.get("part", "")] = (count, total)
    return out


async def stream(client: httpx.AsyncClient) -> bytes:
    body = {"model": "m", "prompt": "x", "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        return b"".join([chunk async for chunk in r.aiter_raw()])


async def test_every_part_is_observed_once_a_request() -> None:
    engine = FakeEngine(num_chunks=4, chunk_delay_s=0.02)  # chunks far enough apart to arrive apart
    async with fleet([engine]) as (client, _):
        assert set(await histogram(client, OVERHEAD_SECONDS)) == set(OVERHEAD_PARTS)  # zero series
        for _ in range(3):
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert response.status_code == 200
        for _ in range(2):
            assert (await stream(client)).endswith(b"data: [DONE]\n\n")
        parts = await histogram(client, OVERHEAD_SECONDS)
    assert parts["request"][0] == 5 and parts["first_byte"][0] == 5
    assert parts["stream"][0] == 2  # one a stream (the mean of its later chunks), none a whole body
    for count, total in parts.values():  # seconds, not milliseconds or a clock reading
        assert 0.0 <= total <= count * 4 * GENEROUS_S


async def queue_length(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == QUEUE_LENGTH:
            return sum(s.value for s in family.samples if s.labels.get("model") == "m")
    return 0.0


async def test_a_request_queued_behind_a_saturated_replica_counts_only_its_own_time() -> None:
    engine = FakeEngine(num_waiting=10)  # reports a long queue: saturated
    async with fleet([engine], max_queue_len=4, queue_timeout_s=60) as (client, urls):

        async def is_saturated_known() -> bool:
            return bool((await replicas(client))[urls[0]]["num_waiting"] >= 10)

        async def is_queued() -> bool:
            return await queue_length(client) == 1

        await eventually(is_saturated_known)
        queued = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
        await eventually(is_queued)  # the wait has begun: it lasts at least the sleep below
        await asyncio.sleep(4 * GENEROUS_S)
        engine.num_waiting = 0  # load drops: the queued request goes through
        assert (await queued).status_code == 200
        waits, wait_s = (await histogram(client, QUEUE_WAIT_SECONDS))[""]
        parts = await histogram(client, OVERHEAD_SECONDS)
    assert waits == 1 and wait_s >= 4 * GENEROUS_S
    count, request_s = parts["request"]
    # Had the wait counted, the request part would hold all of it (a second on a loaded machine too).
    assert count == 1 and 0.0 <= request_s < wait_s


async def test_a_failed_attempt_is_left_out_of_the_request_part() -> None:
    slow_failure = FakeEngine(name="bad", mode="error500", answer_delay_s=4 * GENEROUS_S)
    good = FakeEngine(name="good")
    async with fleet([slow_failure, good], policy="round-robin") as (client, _):
        for _ in range(2):  # round robin: at least one goes to the failing replica first
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert response.status_code == 200 and response.json()["served_by"] == "good"
        parts = await histogram(client, OVERHEAD_SECONDS)
    assert len(slow_failure.bodies) >= 1
    count, request_s = parts["request"]
    # Had the failed attempt counted, the part would hold its whole delay.
    assert count == 2 and 0.0 <= request_s < 4 * GENEROUS_S
