"""bench/engine/engine_metrics.py: what a served run did on the engine side, from two scrapes of
its Prometheus text (vLLM's metric names, as both engines export them)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bench.engine import engine_metrics


def _engine() -> tuple[CollectorRegistry, Histogram, Histogram, Counter]:
    registry = CollectorRegistry()
    queue = Histogram(
        "vllm:request_queue_time_seconds", "q", ["model_name"], buckets=(0.1, 0.5, 1.0), registry=registry
    )
    steps = Histogram(
        "vllm:iteration_tokens_total", "t", ["model_name"], buckets=(1, 64, 2048), registry=registry
    )
    preempted = Counter("vllm:num_preemptions", "p", ["model_name"], registry=registry)
    return registry, queue, steps, preempted


def test_corral_step_time_is_summed() -> None:
    registry = CollectorRegistry()
    step = Histogram(
        "corral_engine_step_duration_seconds", "s", ["model_name"], buckets=(0.1, 1.0), registry=registry
    )
    before = engine_metrics.parse(generate_latest(registry).decode())
    for seconds in (0.05, 0.25, 0.5):
        step.labels("m").observe(seconds)
    d = engine_metrics.delta(before, engine_metrics.parse(generate_latest(registry).decode()))
    assert d is not None and d["step_s"]["count"] == 3
    assert d["step_s"]["mean"] * d["step_s"]["count"] == pytest.approx(0.8)
    assert "in 0.80 s" in engine_metrics.describe(d)


def test_delta_counts_only_what_happened_between_the_scrapes() -> None:
    registry, queue, steps, preempted = _engine()
    queue.labels("m").observe(0.9)  # before the run: must not count
    before = engine_metrics.parse(generate_latest(registry).decode())
    for value in (0.05, 0.2, 0.3, 0.4):
        queue.labels("m").observe(value)
    for tokens in (1, 1, 1000):
        steps.labels("m").observe(tokens)
    preempted.labels("m").inc(2)
    after = engine_metrics.parse(generate_latest(registry).decode())
    d = engine_metrics.delta(before, after)
    assert d is not None
    assert d["queue_s"]["count"] == 4
    assert d["queue_s"]["mean"] == pytest.approx(0.2375)
    # 4 observations: one in (0, 0.1], three in (0.1, 0.5]; the median's rank 2 is a third of the
    # way into the second bucket, the p99 near its top.
    assert d["queue_s"]["p50"] == pytest.approx(0.1 + 0.4 / 3)
    assert 0.45 < d["queue_s"]["p99"] <= 0.5
    assert d["step_tokens"]["count"] == 3 and d["step_tokens"]["mean"] == pytest.approx(334.0)
    assert d["preemptions"] == 2
    assert "prefill_s" not in d  # not exported here: left out, not zero
    line = engine_metrics.describe(d)
    assert "queue 238 ms" in line and "3 steps of 334 tokens" in line and "2 preempted" in line


def test_a_failed_scrape_gives_no_delta() -> None:
    registry, *_ = _engine()
    snap = engine_metrics.parse(generate_latest(registry).decode())
    assert engine_metrics.delta(None, snap) is None
    assert engine_metrics.delta(snap, None) is None
    assert engine_metrics.scrape("http://127.0.0.1:9", timeout_s=0.5) is None  # nothing listens there


def test_the_collectors_full_passes_are_read_apart_from_the_rest() -> None:
    registry = CollectorRegistry()
    passes = Histogram(
        "corral_engine_gc_pause_seconds", "g", ["generation"], buckets=(0.001, 0.1), registry=registry
    )
    before = engine_metrics.parse(generate_latest(registry).decode())
    for generation, seconds in (("0", 0.001), ("0", 0.001), ("2", 0.05)):
        passes.labels(generation).observe(seconds)
    d = engine_metrics.delta(before, engine_metrics.parse(generate_latest(registry).decode()))
    assert d is not None
    assert d["gc_s"]["count"] == 3 and d["gc_s"]["count"] * d["gc_s"]["mean"] == pytest.approx(0.052)
    assert d["gc_full_s"]["count"] == 1 and d["gc_full_s"]["mean"] == pytest.approx(0.05)
