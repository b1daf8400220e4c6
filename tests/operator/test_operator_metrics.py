"""Metrics sources: Prometheus text parsing, a real scrape over loopback, the file source."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from corral_operator.metrics import FileSource, PodScrapeSource, PodTarget, parse_gauges

EXPOSITION = """# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 6.0
vllm:num_requests_running{model_name="tiny"} 2.0
vllm:kv_cache_usage_perc{model_name="tiny"} 0.5
vllm:num_requests_waiting_extra 99
vllm:prompt_tokens_total{model_name="tiny"} 1234.0
# TYPE vllm:request_success counter
vllm:request_success_total{model_name="tiny",finished_reason="stop"} 7.0
vllm:request_success_total{model_name="tiny",finished_reason="length"} 2.0
"""


def test_parse_gauges_reads_wanted_gauges_only() -> None:
    assert parse_gauges(EXPOSITION) == {
        "vllm:num_requests_waiting": 6.0,
        "vllm:num_requests_running": 2.0,
        "vllm:kv_cache_usage_perc": 0.5,
        "vllm:request_success_total": 9.0,  # the autoscaler's activity between scrapes
    }
    assert parse_gauges('garbage\nvllm:kv_cache_usage_perc{x="y"} nan-ish\n') == {}


def test_a_pod_with_several_engines_reports_its_fullest_kv_cache_not_a_sum() -> None:
    """vLLM with --data-parallel-size 2 in one pod: a series per engine. Requests add up; two
    caches at 0.6 and 0.7 are not 130 % used."""
    exposition = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
"""
    assert parse_gauges(exposition) == {"vllm:kv_cache_usage_perc": 0.7, "vllm:num_requests_waiting": 7.0}


@pytest.fixture
def engine_metrics() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = EXPOSITION.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_pod_scrape_aggregates_replicas(engine_metrics: int) -> None:
    source = PodScrapeSource(timeout_s=2, allowed_networks=["127.0.0.0/8"])
    targets = [PodTarget("a", "127.0.0.1", engine_metrics), PodTarget("b", "127.0.0.1", engine_metrics)]
    load = source.load("ns", "tiny", targets)
    assert load is not None
    assert (load.num_waiting, load.num_running, load.kv_usage_ratio, load.num_reporting) == (12, 4, 0.5, 2)
    assert load.num_finished == 18


def test_pod_scrape_counts_the_ready_pods_that_did_not_answer(engine_metrics: int) -> None:
    source = PodScrapeSource(timeout_s=0.5, allowed_networks=["127.0.0.0/8"])
    targets = [PodTarget("a", "127.0.0.1", engine_metrics), PodTarget("b", "127.0.0.1", 9)]
    load = source.load("ns", "tiny", targets)
    assert load is not None
    assert (load.num_waiting, load.num_reporting, load.num_unreported) == (6, 1, 1)


def test_pod_scrape_skips_pods_outside_allowed_networks() -> None:
    source = PodScrapeSource(timeout_s=0.5, allowed_networks=["127.0.0.0/8"])
    # 10.0.0.1 is never dialled: it is outside the allowed network
    assert source.load("ns", "tiny", [PodTarget("a", "10.0.0.1", 8000)]) is None


def test_unreachable_pod_gives_no_load_and_one_warning(
    engine_metrics: int, caplog: pytest.LogCaptureFixture
) -> None:
    source = PodScrapeSource(timeout_s=0.5, allowed_networks=["127.0.0.0/8"])
    for _ in range(3):
        assert source.load("ns", "tiny", [PodTarget("a", "127.0.0.1", 9)]) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "ns/tiny: none of 1 ready pods answered" in warnings[0]
    assert "builtin autoscaling holds" in warnings[0] and ":9/metrics" in warnings[0]
    assert source.load("ns", "tiny", [PodTarget("a", "127.0.0.1", engine_metrics)]) is not None
    assert source.load("ns", "tiny", [PodTarget("a", "127.0.0.1", 9)]) is None  # failing again: said again
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2


def test_file_source(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"ns/tiny": {"waiting": 40, "running": 8, "kvUsage": 0.9}}))
    source = FileSource(path)
    load = source.load("ns", "tiny", [PodTarget("a", "127.0.0.1", 1)])
    assert load is not None and load.num_waiting == 40 and load.kv_usage_ratio == 0.9
    assert source.load("ns", "other", [PodTarget("a", "127.0.0.1", 1)]) is None
    path.write_text("{not json")
    assert source.load("ns", "tiny", [PodTarget("a", "127.0.0.1", 1)]) is None
