"""The admission queue: priority order, fairness across keys, bounds, deadlines, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from corral_gateway.admission import Admission, Ask
from corral_gateway.errors import RateLimited, Unavailable
from corral_gateway.fair_queue import FairQueue
from corral_gateway.load import LoadSample
from corral_gateway.policies import make_policy
from corral_gateway.registry import Registry, Replica, Saturation
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


def test_a_full_queue_makes_room_for_a_key_holding_less_of_it() -> None:
    queue: FairQueue[str] = FairQueue(max_len=4)
    for i in range(4):
        assert queue.push(f"greedy{i}", key="greedy")
    assert queue.evict_for(0, "greedy") is None  # a key cannot push itself out
    assert queue.evict_for(0, "polite") == "greedy3"  # the greedy key's newest request goes
    assert queue.push("polite0", key="polite")
    assert queue.evict_for(0, "polite") == "greedy2"  # 3 against 1: still the greedy key's
    assert queue.push("polite1", key="polite")
    assert queue.evict_for(0, "polite") is None  # 2 and 2: equal shares, nobody is pushed out
    assert queue.evict_for(0, "third") == "greedy1"  # a third key gets a place: 1, 2 and 1
    assert queue.push("third0", key="third")
    assert queue.evict_for(0, "fourth") == "polite1"  # a fourth too: one each
    assert queue.push("fourth0", key="fourth")
    assert queue.evict_for(0, "fifth") is None
    assert [queue.pop() for _ in range(4)] == ["greedy0", "polite0", "third0", "fourth0"]


def test_a_full_queue_gives_a_lower_prioritys_place_never_a_higher_ones() -> None:
    queue: FairQueue[str] = FairQueue(max_len=3)
    queue.push("urgent0", priority=5, key="greedy")
    queue.push("urgent1", priority=5, key="greedy")
    queue.push("low", priority=0, key="greedy")
    assert queue.evict_for(0, "polite") == "low"  # only places at or below its own priority
    queue.push("polite", priority=0, key="polite")
    assert queue.evict_for(0, "third") is None  # greedy's other places outrank the newcomer
    assert queue.evict_for(5, "third") == "polite"  # a higher priority takes a lower one's place
    assert queue.push("third", priority=5, key="third")
    assert queue.evict_for(5, "fourth") == "urgent1"  # at its own priority: greedy holds 2
    assert queue.push("fourth", priority=5, key="fourth")
    assert queue.evict_for(5, "fifth") is None  # one place each
    assert queue.evict_for(4, "fifth") is None  # and every place outranks it
    assert [queue.pop() for _ in range(3)] == ["urgent0", "third", "fourth"]


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
    low = asyncio.create_task(admission.acquire(Ask("m", priority=0, fairness_key="k1")))
    low.add_done_callback(lambda _: order.append("low"))
    high = asyncio.create_task(admission.acquire(Ask("m", priority=9, fairness_key="k2")))
    high.add_done_callback(lambda _: order.append("high"))
    await asyncio.sleep(0.01)
    assert admission.queue_len("m") == 2 and not low.done() and not high.done()
    replica = router.registry.replicas("m")[0]
    for _ in range(3):  # three requests finish: 6 still waiting, still saturated
        replica.on_done()
    admission.pump("m")
    await asyncio.sleep(0.01)
    assert not low.done() and not high.done()
    replica.on_done()  # a fourth: 5 waiting, room for one more
    admission.pump("m")
    await asyncio.wait_for(high, 1)
    await asyncio.sleep(0.01)
    assert order == ["high"] and not low.done()  # the one it sent counts: 6 waiting again
    replica.on_done()
    admission.pump("m")
    await asyncio.wait_for(low, 1)
    assert order == ["high", "low"]
    assert replica.num_inflight == 1  # on_done stands for any finished request, here one of ours
    admission.release(replica)
    assert replica.num_inflight == 0


async def test_queued_requests_spread_over_freed_room_instead_of_rushing_one_replica() -> None:
    """When a finished request drops one replica just under the KV threshold, one queued request
    goes there, not the whole queue; the rest follow as room appears elsewhere."""
    now = [100.0]
    registry = Registry()
    registry.set_replicas("m", ["http://a", "http://b"])
    for url in ("http://a", "http://b"):
        registry.observe(url, LoadSample(8, 0, 0.85, at_s=now[0]))  # KV over 0.8: saturated
    router = Router(registry, make_policy("prefix-affinity", SAT), SAT, 2.0, clock=lambda: now[0])
    admission = Admission(router, max_queue_len=8, timeout_s=5.0)
    waiters = [asyncio.create_task(admission.acquire(Ask("m", 1234))) for _ in range(4)]
    await asyncio.sleep(0.01)
    assert admission.queue_len("m") == 4
    a, b = registry.replicas("m")
    a.on_done()  # a frees ~0.11 of its KV: 0.74
    admission.pump("m")
    await asyncio.sleep(0.01)
    assert sum(w.done() for w in waiters) == 1 and a.num_inflight == 1
    b.on_done()
    admission.pump("m")
    await asyncio.sleep(0.01)
    assert sum(w.done() for w in waiters) == 2 and b.num_inflight == 1
    registry.observe("http://a", LoadSample(4, 0, 0.4, at_s=now[0] + 0.05))  # a fresh, lighter sample
    now[0] += 0.05
    admission.pump("m")
    await asyncio.wait_for(asyncio.gather(*waiters), 1)
    assert a.num_inflight == 3


async def test_full_queue_answers_429_with_retry_after() -> None:
    now = [100.0]
    admission = Admission(saturated_fleet(now), max_queue_len=1, timeout_s=5.0)
    waiting = asyncio.create_task(admission.acquire(Ask("m")))
    await asyncio.sleep(0)
    with pytest.raises(RateLimited) as info:
        await admission.acquire(Ask("m"))
    assert info.value.status_code == 429 and "retry-after" in info.value.headers()
    waiting.cancel()


async def test_deadline_gives_503_and_leaves_the_queue() -> None:
    now = [100.0]
    admission = Admission(saturated_fleet(now), max_queue_len=4, timeout_s=0.05)
    with pytest.raises(Unavailable):
        await admission.acquire(Ask("m"))
    assert admission.queue_len("m") == 0


async def test_cancelled_waiter_leaves_the_queue() -> None:
    now = [100.0]
    admission = Admission(saturated_fleet(now), max_queue_len=4, timeout_s=5.0)
    task = asyncio.create_task(admission.acquire(Ask("m")))
    await asyncio.sleep(0.01)
    assert admission.queue_len("m") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert admission.queue_len("m") == 0


async def test_one_keys_burst_cannot_shut_another_key_out_of_a_full_queue() -> None:
    now = [100.0]
    router = saturated_fleet(now)
    admission = Admission(router, max_queue_len=3, timeout_s=5.0)
    burst = [asyncio.create_task(admission.acquire(Ask("m", fairness_key="greedy"))) for _ in range(3)]
    await asyncio.sleep(0.01)
    other = asyncio.create_task(admission.acquire(Ask("m", fairness_key="polite")))
    await asyncio.sleep(0.01)
    assert admission.queue_len("m") == 3 and not other.done()
    with pytest.raises(RateLimited) as info:  # the burst's newest request gave up its place
        await asyncio.wait_for(burst[2], 1)
    assert info.value.code == "queue_full" and info.value.status_code == 429
    replica = router.registry.replicas("m")[0]
    for _ in range(5):  # room for two: the burst's first, then the other key's request
        replica.on_done()
    admission.pump("m")
    await asyncio.wait_for(asyncio.gather(burst[0], other), 1)
    assert not burst[1].done()
    burst[1].cancel()


def test_a_held_item_keeps_its_place_and_leaves_its_keys_turns_to_the_keys_other_items() -> None:
    queue: FairQueue[str] = FairQueue(max_len=10)
    for item in ("a1", "a2", "a3", "b1", "b2"):
        queue.push(item, key=item[0])
    assert list(queue.ordered()) == ["a1", "b1", "a2", "b2", "a3"]
    assert queue.hold("a1") and not queue.hold("a1")
    assert list(queue.ordered()) == ["a1", "a2", "b1", "a3", "b2"]
    queue.take("a2")  # key a had its turn
    assert list(queue.ordered()) == ["a1", "b1", "a3", "b2"]
    queue.take("b1")
    queue.push("urgent", priority=5, key="b")
    assert list(queue.ordered()) == ["urgent", "a1", "a3", "b2"]  # held, but only first at its priority
    assert queue.pop() == "urgent" and queue.pop() == "a1"
    assert list(queue.ordered()) == ["b2", "a3"]  # no longer held: key a had its turn
    assert not queue.hold("a1")  # gone


def pool_with_adapter_replica(now: list[float]) -> tuple[Router, Replica, Replica]:
    """Pool m: replica a lists adapter sql, b does not; both saturated (9 waiting)."""
    registry = Registry()
    registry.set_replicas("m", ["http://a", "http://b"])
    for url in ("http://a", "http://b"):
        registry.observe(url, LoadSample(8, 9, 0.5, at_s=now[0]))
    a, b = registry.replicas("m")
    a.adapters = {"sql": {}}
    return Router(registry, make_policy("kv-aware", SAT), SAT, 2.0, clock=lambda: now[0]), a, b


def make_room(router: Router, replica: Replica, num_requests: int) -> None:
    """A fresh sample with room for `num_requests` before it is full again (over 5 waiting)."""
    router.registry.observe(replica.url, LoadSample(8, 6 - num_requests, 0.5, at_s=router.clock()))


async def test_a_queued_adapter_request_does_not_hold_up_the_requests_behind_it() -> None:
    """The adapter's only replica is saturated: requests behind its request go to the other replica
    as it makes room, in the queue's order (key a's turn passes to its base request), and the
    adapter request keeps its place: it takes the first room on its replica, before a base request."""
    now = [100.0]
    router, a, b = pool_with_adapter_replica(now)
    admission = Admission(router, max_queue_len=8, timeout_s=5.0)
    asks = {
        "c1": Ask("m", fairness_key="c"),  # first: the adapter request queues behind it
        "sql": Ask("m", fairness_key="a", adapter="sql"),
        "a2": Ask("m", fairness_key="a"),
        "b1": Ask("m", fairness_key="b"),
        "b2": Ask("m", fairness_key="b"),
    }
    tasks = {name: asyncio.create_task(admission.acquire(ask)) for name, ask in asks.items()}
    await asyncio.sleep(0.01)
    assert admission.queue_len("m") == 5
    make_room(router, b, 2)
    admission.pump("m")
    await asyncio.sleep(0.01)
    assert [name for name, task in tasks.items() if task.done()] == ["c1", "a2"]
    assert tasks["a2"].result() is b
    make_room(router, b, 1)
    admission.pump("m")
    await asyncio.wait_for(tasks["b1"], 1)
    assert not tasks["sql"].done() and not tasks["b2"].done()
    make_room(router, a, 1)  # room for one on a, which b2 could take too
    admission.pump("m")
    assert await asyncio.wait_for(tasks["sql"], 1) is a
    await asyncio.sleep(0.01)
    assert not tasks["b2"].done() and admission.queue_len("m") == 1
    tasks["b2"].cancel()


async def test_a_request_excluding_a_replica_does_not_hold_up_those_behind_it() -> None:
    """A retried request may not go back to the replica that failed it; while every other replica
    is full, requests behind it still get that one."""
    now = [100.0]
    router, a, b = pool_with_adapter_replica(now)
    admission = Admission(router, max_queue_len=8, timeout_s=5.0)
    retried = asyncio.create_task(admission.acquire(Ask("m", exclude=["http://b"])))
    later = asyncio.create_task(admission.acquire(Ask("m")))
    await asyncio.sleep(0.01)
    make_room(router, b, 1)
    admission.pump("m")
    assert await asyncio.wait_for(later, 1) is b
    assert not retried.done()
    make_room(router, a, 1)
    admission.pump("m")
    assert await asyncio.wait_for(retried, 1) is a
