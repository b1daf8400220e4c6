"""Operator settings: built once at the edge from `corral operator`'s flags (a CORRAL_OPERATOR_*
variable fills one no flag gives), logged once at start-up, passed down, never mutated."""

from __future__ import annotations

import ipaddress
import random
import time
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ANY_NETWORK = ("0.0.0.0/0", "::/0")


PRIORITY_EPOCH_S = 1_735_689_600  # 2025-01-01T00:00:00Z
PRIORITY_RANDOM_BITS = 13


def _start_priority() -> int:
    """The newest replica outranks older ones: a restarted operator (a crash, an OOM kill, a
    rollout's new pod) works at once, where a random priority lower than its predecessor's made it
    wait up to kopf's peering lifetime (60 s) for that dead replica's record to expire. Milliseconds
    since PRIORITY_EPOCH_S, then random bits, so two replicas started in the same millisecond still
    do not tie (kopf pauses every replica of a tie); an exact JSON number until about 2059."""
    started_ms = int((time.time() - PRIORITY_EPOCH_S) * 1000)
    return (started_ms << PRIORITY_RANDOM_BITS) + random.SystemRandom().randrange(1 << PRIORITY_RANDOM_BITS)


class OperatorSettings(BaseSettings):
    """Everything `corral operator` needs, validated once at start-up and never mutated."""

    model_config = SettingsConfigDict(env_prefix="CORRAL_OPERATOR_", frozen=True, extra="forbid")

    namespaces: tuple[str, ...] = ()  # () serves every namespace
    kubeconfig: Path | None = None  # None: the pod's service account, else $KUBECONFIG / ~/.kube/config
    peering: str = "corral"  # kopf peering shared by replicas; only the highest priority one works
    standalone: bool = False  # no peering (a single replica, dev clusters)
    priority: int = Field(default_factory=_start_priority)
    liveness_url: str | None = "http://0.0.0.0:8080/healthz"
    metrics_port: int | None = Field(default=None, ge=1, le=65535)  # the operator's own /metrics
    # The timer re-asserts desired state, refreshes status and runs the autoscaler this often.
    resync_s: float = Field(default=15.0, gt=0)
    scrape_metrics: bool = True  # scrape the engine pods' /metrics (autoscaling needs load)
    metrics_file: Path | None = None  # read load from this JSON file instead of scraping
    scrape_networks: tuple[str, ...] = ANY_NETWORK  # only pods whose IP is in one are scraped
    # Labels on each LLMDeployment's ServiceMonitor: what a Prometheus selects monitors by (the
    # chart passes monitoring.labels, e.g. release: kube-prometheus-stack).
    monitor_labels: dict[str, str] = Field(default_factory=dict)
    # How often Prometheus scrapes the engines through that ServiceMonitor (the chart passes
    # monitoring.interval); the Prometheus Operator's duration format, checked here so a typo fails
    # at start-up rather than every ServiceMonitor apply.
    monitor_interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m|h)$")

    @field_validator("scrape_networks")
    @classmethod
    def _check_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for network in value:
            ipaddress.ip_network(network)  # raises ValueError with the offending text
        return value

    def describe(self) -> str:
        """One log line: every setting and its value."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in type(self).model_fields)
