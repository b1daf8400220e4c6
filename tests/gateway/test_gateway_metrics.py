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


def test_a_replica_leaving_discovery_takes_its_series_with_it() -> None:
    """Each pod that came and went used to leave its per-replica series behind for good: with pod
    churn, the label sets only grew."""
    metrics = GatewayMetrics()
    fleet = Fleet(GatewaySettings(kubernetes={"enabled": True}), metrics)
    fleet.apply_discovery(Discovery({"m": ["http://a", "http://b"], "n": ["http://b"]}, {}))
    fleet.update_gauges()
    metrics.count_request("m", "http://a", "503")
    fleet.apply_discovery(Discovery({"m": ["http://b"]}, {}))  # a gone; b serves m only now
    for status in ("200", "503"):
        assert (
            value(metrics, "corral_gateway_requests_total", model="m", replica="http://a", status=status)
            is None
        )
    for gauge in ("replica_healthy", "replica_score", "replica_inflight"):
        assert value(metrics, f"corral_gateway_{gauge}", model="m", replica="http://a") is None
        assert value(metrics, f"corral_gateway_{gauge}", model="n", replica="http://b") is None
    assert value(metrics, "corral_gateway_ejections_total", replica="http://a") is None
    assert_zero_series(metrics, "m", "http://b")  # still served at that URL: its ejections stay
    fleet.apply_discovery(Discovery({"m": ["http://a", "http://b"]}, {}))  # the URL comes back
    assert_zero_series(metrics, "m", "http://a")


def test_the_process_reports_its_own_memory_cpu_and_files() -> None:
    # the dashboards' Memory row reads it; prometheus_client's names, as every Python exporter's
    metrics = GatewayMetrics()
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert (value(metrics, name) or 0) > 0, name
