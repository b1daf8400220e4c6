"""The gateway's own Prometheus metrics (`corral_gateway_*`), in a registry per app instance.

Labels never carry API keys or prompts; replicas are labelled by URL.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "corral_gateway_"
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS_TOTAL = PREFIX + "requests_total"
REQUEST_DURATION_SECONDS = PREFIX + "request_duration_seconds"
TIME_TO_FIRST_BYTE_SECONDS = PREFIX + "time_to_first_byte_seconds"
QUEUE_LENGTH = PREFIX + "queue_length"
QUEUE_WAIT_SECONDS = PREFIX + "queue_wait_seconds"
RETRIES_TOTAL = PREFIX + "retries_total"
EJECTIONS_TOTAL = PREFIX + "ejections_total"
REPLICA_SCORE = PREFIX + "replica_score"
REPLICA_HEALTHY = PREFIX + "replica_healthy"
REPLICA_INFLIGHT = PREFIX + "replica_inflight"
REJECTED_TOTAL = PREFIX + "rejected_total"
STREAMS_BROKEN_TOTAL = PREFIX + "streams_broken_total"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            REQUESTS_TOTAL,
            "Requests answered, by model, replica and HTTP status.",
            ["model", "replica", "status"],
            registry=r,
        )
        self.duration = Histogram(
            REQUEST_DURATION_SECONDS,
            "Time from request arrival to the last response byte.",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttfb = Histogram(
            TIME_TO_FIRST_BYTE_SECONDS,
            "Time from request arrival to the first byte from a replica.",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_length = Gauge(
            QUEUE_LENGTH, "Requests waiting in the gateway queue.", ["model"], registry=r
        )
        self.queue_wait = Histogram(
            QUEUE_WAIT_SECONDS,
            "Time requests spent in the gateway queue.",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            RETRIES_TOTAL, "Requests retried on another replica.", ["model", "reason"], registry=r
        )
        self.ejections = Counter(
            EJECTIONS_TOTAL, "Replica ejections after repeated failures.", ["replica"], registry=r
        )
        self.replica_score = Gauge(
            REPLICA_SCORE,
            "The kv-aware cost of each replica (lower is better).",
            ["model", "replica"],
            registry=r,
        )
        self.replica_healthy = Gauge(
            REPLICA_HEALTHY,
            "1 while a replica is in rotation, 0 while ejected.",
            ["model", "replica"],
            registry=r,
        )
        self.replica_inflight = Gauge(
            REPLICA_INFLIGHT,
            "Requests this gateway is proxying to each replica.",
            ["model", "replica"],
            registry=r,
        )
        self.rejected = Counter(
            REJECTED_TOTAL,
            "Requests the gateway answered itself with an error.",
            ["model", "reason"],
            registry=r,
        )
        self.streams_broken = Counter(
            STREAMS_BROKEN_TOTAL,
            "Streams ended with an error event because the replica failed.",
            ["model"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget_replica(self, model: str, url: str) -> None:
        for gauge in (self.replica_score, self.replica_healthy, self.replica_inflight):
            try:
                gauge.remove(model, url)
            except KeyError:
                continue
