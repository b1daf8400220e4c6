"""The soak benchmark's pure parts: the trend, each process's figures, the /metrics reading, the
request mix."""

from __future__ import annotations

import random

import pytest
from corral_engine import wire
from corral_engine.outputs import EngineStats
from corral_engine.server.metrics import ServerMetrics
from corral_gateway.metrics import GC_PAUSE_SECONDS, GatewayMetrics

from bench.soak import report, traffic
from bench.soak.__main__ import metric_figures


def _sample(t_s: float, rss_mib: float, full_passes: float = 0.0, full_s: float = 0.0) -> report.Sample:
    return {
        "t_s": t_s, "rss_mib": rss_mib, "fds": 20.0, "threads": 5.0, "cpu_s": t_s / 10,
        "gc_full_passes": full_passes, "gc_full_s": full_s,
    }  # fmt: skip


def test_the_trend_is_a_least_squares_slope_an_hour() -> None:
    assert report.slope_per_hour([0, 1800, 3600], [100, 110, 120]) == pytest.approx(20.0)
    assert report.slope_per_hour([0, 60, 120, 180], [100, 101, 99, 100]) == pytest.approx(0.0, abs=20)
    assert report.slope_per_hour([5], [1]) == 0.0 and report.slope_per_hour([5, 5], [1, 2]) == 0.0


def test_a_process_summary_leaves_the_warm_up_out_of_the_trend() -> None:
    # memory climbs while the warm-up fills caches, then holds; full passes get slower in the second half
    samples = [_sample(0, 50), _sample(60, 80)] + [
        _sample(t, 100.0, full_passes=t / 60, full_s=(t / 60) * (0.01 if t <= 360 else 0.02))
        for t in range(120, 601, 60)
    ]
    s = report.process_summary(samples, warmup_s=120)
    assert s["rss_mib_start"] == s["rss_mib_end"] == s["rss_mib_peak"] == 100.0
    assert s["rss_mib_per_hour"] == pytest.approx(0.0)
    assert s["num_samples"] == 9 and s["gc_full_passes"] == 8
    assert s["gc_full_pass_ms_first_half"] == pytest.approx(10.0)
    assert s["gc_full_pass_ms_second_half"] > s["gc_full_pass_ms_first_half"]
    row = report.table({"engine": s})
    assert "| engine | 100.0 / 100.0 / 100.0 | +0.0 |" in row


def test_outcomes_count_each_kind() -> None:
    pairs = [("stream", "ok"), ("stream", "ok"), ("stream", "status 500"), ("invalid", "ok")]
    assert report.outcomes(pairs) == {"invalid": {"ok": 1}, "stream": {"ok": 2, "status 500": 1}}


def test_metrics_are_read_from_both_servers_pages() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        kv_usage_ratio=0.25,
        num_prefix_cache_hits_total=64,
        num_preemptions_total=1,
    )
    engine = metric_figures(ServerMetrics(lambda: stats, "m", 128).render().decode(), wire.GC_PAUSE_SECONDS)
    assert (engine["running"], engine["waiting"], engine["kv_usage"]) == (3, 2, 0.25)
    assert (engine["prefix_hit_tokens"], engine["preemptions"]) == (64, 1)
    gateway = metric_figures(GatewayMetrics().render().decode(), GC_PAUSE_SECONDS)
    assert "running" not in gateway and "preemptions" not in gateway and gateway["gc_full_passes"] >= 0


def test_every_kind_asks_for_what_it_is_checked_against() -> None:
    rng = random.Random(0)
    by_name = {k.name: traffic.body(k, i, "m", rng) for i, k in enumerate(traffic.KINDS)}
    assert by_name["invalid"]["temperature"] < 0 and by_name["unknown_model"]["model"] != "m"
    assert by_name["n2"]["n"] == 2 and "prompt" in by_name["whole"]
    assert by_name["disconnect"]["stream"] and by_name["disconnect"]["max_tokens"] > 2
    assert by_name["stream"]["messages"][0]["content"].startswith("0 ")
    assert by_name["shared_prefix"]["prompt"].startswith(traffic.PREAMBLE + " ")
    sampled = by_name["sampled"]
    assert sampled["temperature"] > 0 and sampled["seed"] == 3 and sampled["stop"]
    assert sampled["logprobs"] is True and sampled["top_logprobs"] == 2
    assert sum(k.weight for k in traffic.KINDS) == pytest.approx(1.0)


def _kind(name: str) -> traffic.Kind:
    return next(k for k in traffic.KINDS if k.name == name)


def _whole(kind_name: str, tokens: int, entries: int, alternatives: int = 2, choices: int = 1) -> str:
    kind = _kind(kind_name)
    content = [{"token": "a", "logprob": -1.0, "top_logprobs": [{}] * alternatives} for _ in range(entries)]
    choice = {"index": 0, "text": "a", "logprobs": {"content": content}}
    doc = {"choices": [choice] * choices, "usage": {"completion_tokens": tokens}}
    return traffic.check_whole(kind, doc, exact_logprobs=True)


def test_a_sampled_answer_needs_a_log_probability_for_every_token_it_was_charged() -> None:
    assert _whole("sampled", tokens=5, entries=5) == "ok"
    assert _whole("sampled", tokens=5, entries=4) == "logprobs do not match the tokens"
    assert _whole("sampled", tokens=5, entries=5, alternatives=1) == "logprobs do not match the tokens"
    assert _whole("n2", tokens=5, entries=0, choices=2) == "ok"
    assert _whole("n2", tokens=5, entries=0, choices=1) == "wrong choices"
    # the simulator computes none: only the field's presence is checked against it
    sim = {"choices": [{"logprobs": {"content": []}}], "usage": {"completion_tokens": 5}}
    assert traffic.check_whole(_kind("sampled"), sim, exact_logprobs=False) == "ok"
    assert traffic.check_whole(_kind("sampled"), {"choices": [{}]}, exact_logprobs=False) == "no logprobs"
