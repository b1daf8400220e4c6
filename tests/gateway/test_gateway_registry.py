"""Replica registry: load estimates, staleness, ejection and re-admission."""

from __future__ import annotations

import pytest
from corral_gateway.load import LoadSample
from corral_gateway.registry import Ejection, Registry, Replica, Saturation


def test_dispatches_since_sample_count_as_running_until_the_engine_queues() -> None:
    replica = Replica("m", "http://a")
    replica.observe(LoadSample(2, 0, 0.1, at_s=10.0))
    replica.on_dispatch()
    replica.on_dispatch()
    load = replica.load(10.05, 2.0)
    assert (load.num_running, load.num_waiting, load.num_inflight) == (4, 0, 2)
    assert load.kv_usage_ratio == pytest.approx(0.2)  # two more requests of ~0.05 each
    replica.observe(LoadSample(4, 1, 0.2, at_s=10.1))  # a fresh sample absorbs them
    replica.on_dispatch()
    load = replica.load(10.15, 2.0)
    assert (load.num_running, load.num_waiting) == (4, 2)


def test_finished_requests_free_slots_for_waiting_ones() -> None:
    replica = Replica("m", "http://a")
    replica.observe(LoadSample(4, 2, 0.8, at_s=10.0))
    for _ in range(3):
        replica.on_done()
    load = replica.load(10.05, 2.0)
    assert (load.num_running, load.num_waiting) == (3, 0)
    assert load.kv_usage_ratio == pytest.approx(0.2)
    assert not load.is_saturated(Saturation())


def test_older_sample_does_not_replace_newer() -> None:
    replica = Replica("m", "http://a")
    replica.observe(LoadSample(5, 5, 0.5, at_s=10.0))
    replica.observe(LoadSample(1, 1, 0.1, at_s=9.0))
    assert replica.sample is not None and replica.sample.num_running == 5


def test_stale_load_falls_back_to_in_flight_and_is_never_saturated() -> None:
    replica = Replica("m", "http://a")
    replica.observe(LoadSample(5, 50, 0.99, at_s=10.0))
    replica.on_dispatch()
    load = replica.load(12.5, 2.0)
    assert not load.is_fresh
    assert load.num_outstanding == 1
    assert not load.is_saturated(Saturation())
    assert replica.load(11.0, 2.0).is_saturated(Saturation())


def test_ejection_after_consecutive_failures_then_probe_and_readmit() -> None:
    registry = Registry(Ejection(after_failures=3, base_s=2.0, max_s=30.0))
    registry.set_replicas("m", ["http://a", "http://b"])
    assert not registry.record_failure("http://a", 0.0)
    registry.record_success("http://a")  # success resets the streak
    assert not registry.record_failure("http://a", 0.0)
    assert not registry.record_failure("http://a", 0.0)
    assert registry.record_failure("http://a", 0.0)
    assert [r.url for r in registry.candidates("m")] == ["http://b"]
    assert not registry.is_due_for_probe("http://a", 1.0)
    assert registry.is_due_for_probe("http://a", 2.0)
    registry.probe_failed("http://a", 2.0)  # backs off: 4 s this time
    assert not registry.is_due_for_probe("http://a", 5.0)
    assert registry.is_due_for_probe("http://a", 6.0)
    assert registry.readmit("http://a")
    assert len(registry.candidates("m")) == 2


def test_set_replicas_keeps_state_of_known_replicas() -> None:
    registry = Registry()
    registry.set_replicas("m", ["http://a", "http://b"])
    registry.replicas("m")[0].on_dispatch()
    registry.set_replicas("m", ["http://a", "http://c"])
    by_url = {r.url: r for r in registry.replicas("m")}
    assert set(by_url) == {"http://a", "http://c"}
    assert by_url["http://a"].num_inflight == 1
    registry.remove_model("m")
    assert registry.models() == []


def test_last_replica_in_rotation_is_never_ejected() -> None:
    registry = Registry(Ejection(after_failures=1))
    registry.set_replicas("m", ["http://a", "http://b"])
    assert registry.record_failure("http://a", 0.0)
    assert not registry.record_failure("http://b", 0.0)
    assert [r.url for r in registry.candidates("m")] == ["http://b"]


def test_a_last_replica_past_the_threshold_stays_in_rotation_but_is_failing() -> None:
    # The withheld ejection is still seen: the gauge and /health read `is_answering`.
    registry = Registry(Ejection(after_failures=2))
    registry.set_replicas("m", ["http://a"])
    (replica,) = registry.replicas("m")
    assert not registry.record_failure("http://a", 0.0)
    assert replica.is_answering and not replica.is_failing
    assert not registry.record_failure("http://a", 0.0)
    assert replica.is_failing and not replica.is_answering and not replica.is_ejected
    assert registry.candidates("m") == [replica]  # requests still try it
    assert registry.poll_succeeded("http://a") == [replica]  # it answers polls again
    assert replica.is_answering and replica.num_consecutive_failures == 0
    registry.record_failure("http://a", 0.0)
    registry.record_failure("http://a", 0.0)
    registry.record_success("http://a")  # so does a request it answers
    assert replica.is_answering


def test_a_healthy_poll_leaves_a_streak_below_the_threshold_and_ejected_replicas_alone() -> None:
    # A replica answering polls while failing requests is still ejected after the streak.
    registry = Registry(Ejection(after_failures=2))
    registry.set_replicas("m", ["http://a", "http://b"])
    registry.record_failure("http://a", 0.0)
    assert registry.poll_succeeded("http://a") == []
    assert registry.record_failure("http://a", 0.0)
    (a, _) = registry.replicas("m")
    assert a.is_failing and a.is_ejected
    assert registry.poll_succeeded("http://a") == [] and a.is_failing  # only a probe readmits it
    assert registry.readmit("http://a") and a.is_answering


def test_load_is_recomputed_whenever_an_input_changes_and_reused_otherwise() -> None:
    replica = Replica("m", "http://a")
    replica.observe(LoadSample(num_running=4, num_waiting=2, kv_usage_ratio=0.4, at_s=10.0))
    first = replica.load(10.5, 2.0)
    assert replica.load(10.6, 2.0) is first  # nothing changed
    replica.on_dispatch()
    sent = replica.load(10.6, 2.0)
    assert sent.num_waiting == 3 and sent.num_inflight == 1
    replica.on_done()
    assert replica.load(10.6, 2.0).num_waiting_reported == 1  # a finished request left the queue
    assert not replica.load(12.5, 2.0).is_fresh  # the sample aged out
    replica.observe(LoadSample(num_running=1, num_waiting=0, kv_usage_ratio=0.1, at_s=12.5))
    assert replica.load(12.5, 2.0).num_running == 1
    replica.sample = None  # as an ejection does
    assert not replica.load(12.5, 2.0).is_fresh
