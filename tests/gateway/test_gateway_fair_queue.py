"""The admission queue: priority order, fairness across keys, bounds, deadlines, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from corral_gateway.admission import Admission
from corral_gateway.errors import RateLimited, Unavailable
from corral_gateway.fair_queue import FairQueue
from corral_gateway.load import LoadSample
from corral_gateway.policies import make_policy
from corral_gateway.registry import Registry, Saturation
from corral_gateway.router import Router


def test_priority_first_then_round_robin_across_keys() -> None:
    queue: FairQueue[str] = FairQueue(max_len=100)
    for i in range(4):
        queue.push(f"greedy{i}", priority=0, key="greedy")
    queue.push("polite0", priority=0, key="polite")
    queue.push("urgent", priority=5, key="greedy")
    order = [queue.pop() for _ in range(len(queue))]
    assert order == ["urgent", "greedy0", "polite0", "greedy1", "greedy2", "greedy3"]
    assert queue.pop() is None


def test_bounded_and_remove_by_identity() -> None:
    queue: FairQueue[list[int]] = FairQueue(max_len=2)
    a, b = [1], [1]  # equal but distinct
    assert queue.push(a) and queue.push(b)
    assert not queue.push([2])
    assert queue.remove(b)
    assert not queue.remove(b)
    assert queue.pop() is a
    assert len(queue) == 0


SAT = Saturation(max_waiting=5, max_kv_usage_ratio=0.8)


def saturated_fleet(now: list[float]) -> Router:
    registry = Registry()
    registry.set_replicas("m", ["http://a"])
    registry.observe("http://a", LoadSample(8, 9, 0.5, at_s=now[0]))
    return Router(registry, make_policy("kv-aware", SAT), SAT, 2.0, clock=lambda: now[0])


async def test_waits_while_saturated_and_is_released_when_load_drops() -> None:
    now = [100.0]
    router = saturated_fleet(now)  # 9 waiting
    admission = Admission(router, max_queue_len=4, timeout_s=5.0)
    order: list[str] = []
    low = asyncio.create_task(admission.acquire("m", None, priority=0, fairness_key="k1"))
    low.add_done_callback(lambda _: order.append("low"))
    high = asyncio.create_task(admission.acquire("m", None, priority=9, fairness_key="k2"))
    high.add_done_callback(lambda _: order.append("high"))
    await asyncio.sleep(0.01)
    assert admission.queue_len("m") == 2 and not low.done() and not high.done()
    replica = router.registry.replicas("m")[0]
    for _ in range(3):  # three requests finish: 6 still waiting, still saturated
        replica.on_done()
    admission.pump("m")
    await asyncio.sleep(0.01)
    assert not low.done() and not high.done()
    replica.on_done()  # a fourth: 5 waiting, no longer saturated
    admission.pump("m")
    await asyncio.wait_for(asyncio.gather(low, high), 1)
    assert order == ["high", "low"]
    assert replica.num_inflight == 2
    admission.release(replica)
    assert replica.num_inflight == 1


async def test_full_queue_answers_429_with_retry_after() -> None:
    now = [100.0]
    admission = Admission(saturated_fleet(now), max_queue_len=1, timeout_s=5.0)
    waiting = asyncio.create_task(admission.acquire("m", None))
    await asyncio.sleep(0)
    with pytest.raises(RateLimited) as info:
        await admission.acquire("m", None)
    assert info.value.status_code == 429 and "retry-after" in info.value.headers()
    waiting.cancel()


async def test_deadline_gives_503_and_leaves_the_queue() -> None:
    now = [100.0]
    admission = Admission(saturated_fleet(now), max_queue_len=4, timeout_s=0.05)
    with pytest.raises(Unavailable):
        await admission.acquire("m", None)
    assert admission.queue_len("m") == 0


async def test_cancelled_waiter_leaves_the_queue() -> None:
    now = [100.0]
    admission = Admission(saturated_fleet(now), max_queue_len=4, timeout_s=5.0)
    task = asyncio.create_task(admission.acquire("m", None))
    await asyncio.sleep(0.01)
    assert admission.queue_len("m") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert admission.queue_len("m") == 0
