"""Leases on replicas: given back exactly once however the holder ends (return, error, cancellation,
client hang-up), including a hang-up or cancellation at the moment the queue hands a replica out.

Each test holds a second lease on the same replica, so a skipped release leaves two in flight and a
doubled one leaves none; `num_finished_since_sample` counts every release.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from corral_engine import wire
from corral_gateway.admission import Ask
from corral_gateway.disconnect import ClientGone, race
from corral_gateway.fleet import Fleet
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.registry import Replica
from corral_gateway.settings import GatewaySettings

URL = "http://a"


def make_fleet(now: list[float]) -> Fleet:
    settings = GatewaySettings(backends={"m": [URL]}, saturation_max_waiting=5)
    return Fleet(settings, GatewayMetrics(), clock=lambda: now[0])


def report_load(fleet: Fleet, now: list[float], num_waiting: int) -> None:
    """A load sample as the replica's response headers would carry it, a little later each time."""
    now[0] += 0.01
    headers = {
        wire.HEADER_NUM_RUNNING: "1",
        wire.HEADER_NUM_WAITING: str(num_waiting),
        wire.HEADER_KV_USAGE: "0",
    }
    fleet.observe_headers(URL, headers)


def queue_len(fleet: Fleet) -> float:
    fleet.update_gauges()
    value = fleet.metrics.registry.get_sample_value("corral_gateway_queue_length", {"model": "m"})
    return value if value is not None else 0.0


async def test_released_once_when_the_block_returns() -> None:
    fleet = make_fleet([100.0])
    async with fleet.lease(Ask("m")) as held:
        async with fleet.lease(Ask("m")) as replica:
            assert replica is held and replica.num_inflight == 2
        assert replica.num_inflight == 1 and replica.num_finished_since_sample == 1
    assert replica.num_inflight == 0 and replica.num_finished_since_sample == 2


async def test_released_once_when_the_block_raises() -> None:
    fleet = make_fleet([100.0])
    async with fleet.lease(Ask("m")) as held:
        with pytest.raises(RuntimeError, match="bug"):
            async with fleet.lease(Ask("m")):
                raise RuntimeError("bug")
        assert held.num_inflight == 1 and held.num_finished_since_sample == 1
    assert held.num_inflight == 0 and held.num_finished_since_sample == 2


async def test_released_once_when_the_holder_is_cancelled() -> None:
    fleet = make_fleet([100.0])
    entered = asyncio.Event()

    async def hold_forever() -> None:
        async with fleet.lease(Ask("m")):
            entered.set()
            await asyncio.sleep(3600)

    async with fleet.lease(Ask("m")) as held:
        task = asyncio.create_task(hold_forever())
        await entered.wait()
        assert held.num_inflight == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert held.num_inflight == 1 and held.num_finished_since_sample == 1
    assert held.num_inflight == 0 and held.num_finished_since_sample == 2


def _end(task: asyncio.Task[Replica], disconnect: asyncio.Future[None], ending: str) -> None:
    """The waiter's handler is cancelled, or its client hangs up."""
    if ending == "cancel":
        task.cancel()
    else:
        disconnect.set_result(None)


async def _queued_behind(
    fleet: Fleet, now: list[float], lease: Callable[[], Awaitable[Replica]]
) -> asyncio.Task[Replica]:
    """Saturate the fleet and start `lease`, which waits in the gateway's queue."""
    report_load(fleet, now, num_waiting=9)
    task = asyncio.create_task(lease())
    for _ in range(100):
        if queue_len(fleet) == 1:
            return task
        await asyncio.sleep(0.001)
    raise AssertionError("the lease did not queue")


@pytest.mark.parametrize("ending", ["cancel", "disconnect"])
async def test_a_queued_lease_that_ends_early_holds_nothing(ending: str) -> None:
    now = [100.0]
    fleet = make_fleet(now)
    disconnect: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def lease() -> Replica:
        async with fleet.lease(Ask("m"), disconnect) as replica:
            return replica

    async with fleet.lease(Ask("m")) as held:
        task = await _queued_behind(fleet, now, lease)
        _end(task, disconnect, ending)
        with pytest.raises(asyncio.CancelledError if ending == "cancel" else ClientGone):
            await task
        assert queue_len(fleet) == 0 and held.num_inflight == 1
    assert held.num_inflight == 0 and held.num_finished_since_sample == 1


@pytest.mark.parametrize("ending", ["cancel", "disconnect"])
async def test_ending_just_as_the_queue_hands_out_a_replica_gives_it_back(ending: str) -> None:
    """The late-acquire path: the replica is handed to the waiter in the same loop step as the
    client hangs up (or the handler is cancelled), so the holder never enters its block."""
    now = [100.0]
    fleet = make_fleet(now)
    disconnect: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    entered: list[Replica] = []

    async def lease() -> Replica:
        async with fleet.lease(Ask("m"), disconnect) as replica:
            entered.append(replica)
            return replica

    async with fleet.lease(Ask("m")) as held:
        task = await _queued_behind(fleet, now, lease)
        report_load(fleet, now, num_waiting=0)  # room again: leaving the block hands the replica on
        _end(task, disconnect, ending)
    with pytest.raises(asyncio.CancelledError if ending == "cancel" else ClientGone):
        await task
    assert not entered
    assert held.num_inflight == 0 and held.num_finished_since_sample == 2  # the held lease's and the waiter's


async def test_race_hands_a_result_that_arrived_too_late_to_on_late() -> None:
    disconnect: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    late: list[str] = []

    async def ignores_cancel() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return "resource"  # finished anyway, as a response head arriving with the cancel would
        raise AssertionError("not cancelled")

    task = asyncio.create_task(race(ignores_cancel(), disconnect, on_late=late.append))
    await asyncio.sleep(0)
    disconnect.set_result(None)
    with pytest.raises(ClientGone):
        await task
    assert late == ["resource"]


async def test_race_cancelled_after_the_result_arrived_hands_it_to_on_late() -> None:
    loop = asyncio.get_running_loop()
    disconnect: asyncio.Future[None] = loop.create_future()
    result: asyncio.Future[str] = loop.create_future()
    late: list[str] = []
    task = asyncio.create_task(race(result, disconnect, on_late=late.append))
    await asyncio.sleep(0)
    result.set_result("resource")  # done in the same step as the caller is cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert late == ["resource"]
