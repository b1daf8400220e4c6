"""The operator's own Prometheus series (`corral_operator_*`): reconcile ticks and their failures,
served on --metrics-port for the chart's PodMonitor and the reconcile-errors alert."""

from __future__ import annotations

from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, start_http_server

PREFIX = "corral_operator_"
RECONCILES_TOTAL = PREFIX + "reconciles_total"
RECONCILE_ERRORS_TOTAL = PREFIX + "reconcile_errors_total"

# Why a tick failed (label `reason`): the kinds errors.to_kopf tells apart, plus a failed apply
# that the tick reports in status instead of raising.
ErrorReason = Literal["invalid_spec", "conflict", "forbidden", "rejected", "api_unavailable", "apply"]
ERROR_REASONS: tuple[ErrorReason, ...] = get_args(ErrorReason)


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reconciles = Counter(
            RECONCILES_TOTAL, "Reconcile ticks run (create, update, resume, timer).", registry=self.registry
        )
        self.errors = Counter(
            RECONCILE_ERRORS_TOTAL,
            "Reconcile ticks that failed, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in ERROR_REASONS:
            self.errors.labels(reason)  # zero series from the first scrape

    def count_error(self, reason: ErrorReason) -> None:
        self.errors.labels(reason).inc()

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve /metrics on a daemon thread."""
        start_http_server(port, addr=address, registry=self.registry)
