"""The gateway's metrics have a zero series for every known model, replica and reason from the start,
and for replicas discovered later as soon as they appear."""

from __future__ import annotations

from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import Discovery
from corral_gateway.metrics import OVERHEAD_PARTS, RETRY_REASONS, GatewayMetrics
from corral_gateway.settings import GatewaySettings


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def assert_zero_series(metrics: GatewayMetrics, model: str, url: str) -> None:
    assert value(metrics, "corral_gateway_requests_total", model=model, replica=url, status="200") == 0.0
    assert value(metrics, "corral_gateway_ejections_total", replica=url) == 0.0
    for reason in RETRY_REASONS:
        assert value(metrics, "corral_gateway_retries_total", model=model, reason=reason) == 0.0
    assert value(metrics, "corral_gateway_streams_broken_total", model=model) == 0.0
    for histogram in ("request_duration_seconds", "time_to_first_byte_seconds", "queue_wait_seconds"):
        assert value(metrics, f"corral_gateway_{histogram}_count", model=model) == 0.0
    for part in OVERHEAD_PARTS:
        assert value(metrics, "corral_gateway_overhead_seconds_count", model=model, part=part) == 0.0


def test_configured_replicas_have_zero_series_at_start() -> None:
    metrics = GatewayMetrics()
    Fleet(GatewaySettings(backends={"m": ["http://a", "http://b"]}), metrics)
    assert_zero_series(metrics, "m", "http://a")
    assert_zero_series(metrics, "m", "http://b")


def test_discovered_replicas_get_zero_series_when_they_appear() -> None:
    metrics = GatewayMetrics()
    fleet = Fleet(GatewaySettings(kubernetes={"enabled": True}), metrics)
    assert value(metrics, "corral_gateway_ejections_total", replica="http://c") is None
    fleet.apply_discovery(Discovery({"late": ["http://c"]}, {}))
    assert_zero_series(metrics, "late", "http://c")
    fleet.update_gauges()
    assert value(metrics, "corral_gateway_replica_healthy", model="late", replica="http://c") == 1.0
    assert value(metrics, "corral_gateway_queue_length", model="late") == 0.0


def test_the_process_reports_its_own_memory_cpu_and_files() -> None:
    # the dashboards' Memory row reads it; prometheus_client's names, as every Python exporter's
    metrics = GatewayMetrics()
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert (value(metrics, name) or 0) > 0, name
