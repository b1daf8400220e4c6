"""The simulated-replica overhead benchmark's pure parts: its profile, prompts and figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from corral_cli.bench.stats import RequestResult
from corral_engine import wire
from corral_engine.sim.perf_model import StepShape, load_profile
from corral_gateway.metrics import GC_PAUSE_SECONDS, GatewayMetrics
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.routing import fleet, overhead_sim, overhead_sim_report


def result(ttft_s: float, e2el_s: float, output_len: int = 10) -> RequestResult:
    return RequestResult(is_success=True, output_len=output_len, ttft_s=ttft_s, e2el_s=e2el_s)


def test_the_profile_takes_the_same_time_for_any_batch(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    num_blocks = overhead_sim.kv_blocks_per_replica(1000, 64, prompt_chars=1024, output_tokens=16)
    assert 4 * 1000 * 1024 / 2 / 16 / 64 <= num_blocks <= 5 * 1000 * 1024 / 2 / 16 / 64
    path.write_text(json.dumps(overhead_sim.sim_profile(0.05, 1000, num_blocks)))
    profile = load_profile(str(path))
    assert profile.max_num_seqs == 1000 and profile.num_kv_blocks == num_blocks
    for shape in (StepShape(1, 1, 10, 1.0), StepShape(900, 300, 90_000, 5e5)):
        assert profile.step_time_s(shape) == pytest.approx(0.05)


def test_prompts_share_the_head_and_nothing_after_it() -> None:
    one, two = overhead_sim.prompts(2, prompt_chars=300, shared_chars=100, output_tokens=7)
    assert isinstance(one.prompt, str) and isinstance(two.prompt, str)
    assert len(one.prompt) == len(two.prompt) == 300 and one.output_len == 7
    assert one.prompt[:100] == two.prompt[:100] and one.prompt[100:110] != two.prompt[100:110]


def test_levels_need_one_value_each() -> None:
    args = overhead_sim.parse_args(
        ["--concurrency", "10", "--replicas", "2", "--rounds", "1", "--output-tokens", "4"]
    )
    assert args.concurrency == [10] and args.replicas == [2]
    with pytest.raises(SystemExit):
        overhead_sim.parse_args(["--concurrency", "10", "20", "30"])


def test_an_arm_reports_percentiles_errors_and_cpu_per_request() -> None:
    results = [result(0.1, 1.0), result(0.2, 2.0), result(0.3, 3.0), RequestResult(error="HTTP 429: busy")]
    arm = overhead_sim_report.arm_summary(results, duration_s=10.0, cpu_s={"gateway": 0.03})
    assert arm["num_ok"] == 3 and arm["num_errors"] == 1 and arm["errors"] == ["HTTP 429: busy"]
    assert arm["ttft_p50_ms"] == pytest.approx(200.0) and arm["e2el_p50_ms"] == pytest.approx(2000.0)
    assert arm["output_tok_s"] == pytest.approx(3.0)
    assert arm["gateway_cpu_ms_per_request"] == pytest.approx(10.0)
    assert arm["gateway_cpu_us_per_token"] == pytest.approx(1000.0)
    assert arm["gateway_cores"] == pytest.approx(0.003)


def test_rounds_pair_each_arm_with_the_direct_one() -> None:
    def arm(ttft_ms: float, tok_s: float, gateway_cpu_s: float = 0.0) -> dict[str, float]:
        figures = {key: ttft_ms for key, _, _ in overhead_sim_report.LATENCY_KEYS}
        return {
            **figures,
            "output_tok_s": tok_s,
            "num_errors": 0,
            "num_ok": 100,
            "duration_s": 10.0,
            "gateway_cpu_s": gateway_cpu_s,
            "gateway_cores": gateway_cpu_s / 10,
            "gateway_cpu_ms_per_request": 10 * gateway_cpu_s,
            "gateway_cpu_us_per_token": 0.0,
            "sim_cores": 0.5,
            "client_cores": 0.1,
            "hop_ttft_mean_ms": ttft_ms / 100,  # 1 ms a request direct
            "hop_e2el_mean_ms": ttft_ms / 50,
        }

    rounds = [
        {"direct": arm(100.0, 1000.0), "gateway": arm(101.0, 990.0, 0.2)},
        {"direct": arm(120.0, 1000.0), "gateway": arm(125.0, 950.0, 0.2)},
        {"direct": arm(90.0, 1000.0), "gateway": arm(89.0, 1000.0, 0.2)},
    ]
    summary = overhead_sim_report.paired(rounds, "gateway", idle_cores=0.01)
    assert summary["added_ttft_p50_ms"] == pytest.approx(1.0)  # the median of +1, +5, -1
    assert summary["added_hop_ttft_mean_ms"] == pytest.approx(0.01)  # the median of +.01, +.05, -.01
    assert summary["added_hop_e2el_mean_ms"] == pytest.approx(0.02)
    assert summary["throughput_ratio"] == pytest.approx(0.99)
    assert summary["gateway_cpu_ms_per_request"] == pytest.approx(2.0)
    assert summary["gateway_busy_cpu_ms_per_request"] == pytest.approx(1.0)  # 0.1 s of the 0.2 idle
    row = overhead_sim_report.table(
        [{"concurrency": 100, "num_replicas": 4, "step_ms": 50.0, "summary": {"gateway": summary}}]
    )
    assert "| 100 | 4 | 50 | gateway | 3 |" in row and "| +0.01 / +0.02 |" in row
    assert row.endswith("| - |")  # no collector figures in these arms
    for i, r in enumerate(rounds):  # the gateway's collector in each round: summed over the rounds
        r["gateway"].update(gc_s=0.1 * (i + 1), gc_full_passes=float(i), gc_full_s=0.05 * i)
    summary = overhead_sim_report.paired(rounds, "gateway")
    assert summary["gateway_gc_s"] == pytest.approx(0.6) and summary["gateway_gc_full_passes"] == 3
    assert overhead_sim_report._collector_cell(summary) == "0.60; 0.15 (3)"


def test_the_hop_is_what_the_client_saw_less_what_the_replicas_saw() -> None:
    """The replicas' histograms (as their /metrics expose them, two models' label sets) give the
    mean latency inside the replicas; the client's mean less that is the hop's own share."""
    registry = CollectorRegistry()
    ttft = Histogram(wire.TIME_TO_FIRST_TOKEN_SECONDS, "ttft", ["model_name"], registry=registry)
    e2e = Histogram(wire.E2E_REQUEST_LATENCY_SECONDS, "e2e", ["model_name"], registry=registry)
    for model, first_s, whole_s in (("a", 0.09, 0.9), ("a", 0.19, 1.9), ("b", 0.29, 2.9)):
        ttft.labels(model).observe(first_s)
        e2e.labels(model).observe(whole_s)
    totals = overhead_sim.latency_totals(generate_latest(registry).decode())
    assert totals["ttft_count"] == totals["e2el_count"] == 3
    assert totals["ttft_sum"] == pytest.approx(0.57) and totals["e2el_sum"] == pytest.approx(5.7)
    hop = overhead_sim_report.hop_summary([result(0.1, 1.0), result(0.2, 2.0), result(0.3, 3.0)], totals)
    assert hop["replica_ttft_mean_ms"] == pytest.approx(190.0)
    assert hop["hop_ttft_mean_ms"] == pytest.approx(10.0) and hop["hop_e2el_mean_ms"] == pytest.approx(100.0)


def test_the_gateways_own_overhead_comes_from_its_histogram_over_each_arm() -> None:
    """The gateway's /metrics (two models), scraped before and after an arm: the arm's requests per
    part, their mean, and a median interpolated within its bucket as histogram_quantile does."""
    metrics = GatewayMetrics()
    for model in ("a", "b"):
        metrics.add_model(model)
    before = overhead_sim_report.overhead_histograms(metrics.render().decode())
    assert before["request"]["count"] == 0 and len(before["request"]["bounds"]) == 13
    for model, request_s in (("a", 0.0003), ("a", 0.0004), ("b", 0.0009), ("b", 0.0004)):
        metrics.overhead.labels(model, "request").observe(request_s)
        metrics.overhead.labels(model, "first_byte").observe(0.00002)
    metrics.overhead.labels("a", "stream").observe(3.0)  # past the last bound
    after = overhead_sim_report.overhead_histograms(metrics.render().decode())
    arm = overhead_sim_report.overhead_change(after, before)
    figures = overhead_sim_report.overhead_figures(arm)
    assert figures["overhead_request_count"] == 4
    assert figures["overhead_request_mean_ms"] == pytest.approx(0.5)
    # Three of four in (0.25, 0.5] ms, none below: the rank 2 lies two thirds up that bucket.
    assert figures["overhead_request_p50_ms"] == pytest.approx(0.25 + 0.25 * 2 / 3)
    # Four in [0, 0.05] ms: the rank 2 lies halfway up the first bucket.
    assert figures["overhead_first_byte_p50_ms"] == pytest.approx(0.025)
    assert figures["overhead_stream_p50_ms"] == pytest.approx(2500.0)  # the last finite bound
    assert figures["overhead_stream_mean_ms"] == pytest.approx(3000.0)
    empty = overhead_sim_report.overhead_figures(overhead_sim_report.overhead_change(after, after))
    assert empty["overhead_request_count"] == 0 and math.isnan(empty["overhead_request_p50_ms"])


def test_the_rounds_pool_the_gateways_own_overhead_into_the_table() -> None:
    metrics = GatewayMetrics()
    metrics.add_model("m")
    empty = overhead_sim_report.overhead_histograms(metrics.render().decode())
    arms = []
    for request_s in (0.0003, 0.0007):  # one request a round
        metrics.overhead.labels("m", "request").observe(request_s)
        now = overhead_sim_report.overhead_histograms(metrics.render().decode())
        arms.append(overhead_sim_report.overhead_change(now, empty))
        empty = now
    pooled = overhead_sim_report.overhead_figures(overhead_sim_report.overhead_total(arms))
    assert pooled["overhead_request_count"] == 2
    assert pooled["overhead_request_mean_ms"] == pytest.approx(0.5)
    summary = {"overhead_first_byte_count": 0.0, "overhead_stream_count": 0.0, **pooled}
    assert overhead_sim_report._overhead_cell(summary) == "0.500 / 0.500; -; -"


def test_the_gateways_collector_passes_come_from_its_histogram() -> None:
    """Seconds in all passes, and the full passes (generation 2) counted and timed, from /metrics."""
    text = "".join(
        f'{GC_PAUSE_SECONDS}_{kind}{{generation="{g}"}} {value}\n'
        for g, count, s in (("0", 90, 0.09), ("1", 9, 0.03), ("2", 2, 0.4))
        for kind, value in (("count", count), ("sum", s))
    )
    text = f"# TYPE {GC_PAUSE_SECONDS} histogram\n{text}"
    totals = overhead_sim_report.collector_totals(text)
    assert totals == pytest.approx({"gc_s": 0.52, "gc_full_passes": 2.0, "gc_full_s": 0.4})
    assert "gc_s" in overhead_sim_report.collector_totals(GatewayMetrics().render().decode())


def test_baseline_env_items_are_kept_as_given() -> None:
    args = overhead_sim.parse_args(
        ["--concurrency", "10", "--replicas", "2", "--rounds", "1", "--output-tokens", "4",
         "--baseline-env", "CORRAL_GC_THRESHOLDS=700,10,10"]
    )  # fmt: skip
    assert args.baseline_env == ["CORRAL_GC_THRESHOLDS=700,10,10"] and args.baseline_gateway is None
    assert fleet.env_pairs(args.baseline_env) == {"CORRAL_GC_THRESHOLDS": "700,10,10"}


def test_env_pairs_keep_an_equals_sign_in_the_value_and_refuse_anything_else() -> None:
    assert fleet.env_pairs(["A=1=2", "B="]) == {"A": "1=2", "B": ""}
    for bad in ("A", "=1"):
        with pytest.raises(SystemExit, match="NAME=VALUE"):
            fleet.env_pairs([bad])
