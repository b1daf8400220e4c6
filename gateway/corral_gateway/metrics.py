"""The gateway's own Prometheus metrics (`corral_gateway_*`), in a registry per app instance.

Labels never carry API keys or prompts; replicas are labelled by URL. Every known label set gets a
zero series as soon as its model or replica is known, so a fresh fleet's dashboards show zeros, and a
replica's series go when it leaves discovery, so pod churn does not grow the label sets for ever.
`overhead_seconds` is the gateway's own share of a request's latency, timed inside the process
(`OverheadPart` says which stretches). The process's own figures (`process_resident_memory_bytes`,
CPU, file descriptors) are prometheus_client's.
"""

from __future__ import annotations

from typing import Literal, get_args

from corral_engine import wire
from corral_engine.gc_pauses import GcPauseCollector
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

PREFIX = "corral_gateway_"
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The gateway's own time per request is tens of microseconds to a few milliseconds; the top
# buckets resolve a loop stalled by a burst of new connections (1,000 streams at once).
_OVERHEAD_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.25, 1, 2.5)
# A healthy loop wakes within a millisecond; a burst on a saturated machine stalled it 0.5-5 s.
_LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

REQUESTS_TOTAL = PREFIX + "requests_total"
REQUEST_DURATION_SECONDS = PREFIX + "request_duration_seconds"
TIME_TO_FIRST_BYTE_SECONDS = PREFIX + "time_to_first_byte_seconds"
QUEUE_LENGTH = wire.GATEWAY_QUEUE_LENGTH  # the operator's KEDA trigger reads it
QUEUE_WAIT_SECONDS = PREFIX + "queue_wait_seconds"
RETRIES_TOTAL = PREFIX + "retries_total"
EJECTIONS_TOTAL = PREFIX + "ejections_total"
REPLICA_SCORE = PREFIX + "replica_score"
REPLICA_HEALTHY = PREFIX + "replica_healthy"
REPLICA_INFLIGHT = PREFIX + "replica_inflight"
REJECTED_TOTAL = PREFIX + "rejected_total"
STREAMS_BROKEN_TOTAL = PREFIX + "streams_broken_total"
KEY_TOKENS_TOTAL = PREFIX + "key_tokens_total"
OVERHEAD_SECONDS = PREFIX + "overhead_seconds"
GC_PAUSE_SECONDS = PREFIX + "gc_pause_seconds"
ADAPTER_ROUTES_TOTAL = PREFIX + "adapter_routes_total"
EVENT_LOOP_LAG_SECONDS = PREFIX + "event_loop_lag_seconds"

# Why a request left a replica before its first byte without an answer (label `reason` of
# retries_total). A retried HTTP answer is labelled `http_<status>` instead: open-ended, so its
# series start with the first such retry.
# `connect_timeout_loop_stall`: a connect timed out while the gateway's own event loop was stalled
# (`loop_lag.is_loop_stall`), so not the replica's fault: it does not count towards ejection.
RetryReason = Literal["connect_error", "connect_timeout", "connect_timeout_loop_stall", "transport_error"]
RETRY_REASONS: tuple[RetryReason, ...] = get_args(RetryReason)
# The stretches of overhead_seconds (label `part`), each timed with time.perf_counter():
# - request: the proxy's handler starting on a request to its bytes all written to the replica's
#   connection, less the waits for a replica (queue_wait) and any failed earlier attempts;
# - first_byte: the replica's first body bytes in the gateway's hands (a whole body: all of it) to
#   their send to the client's connection returning;
# - stream: the same for each later chunk of a streamed body, one observation per request (the
#   mean over its chunks).
OverheadPart = Literal["request", "first_byte", "stream"]
OVERHEAD_PARTS: tuple[OverheadPart, ...] = get_args(OverheadPart)
# Where LoRA affinity sent an adapter request (label `affinity` of adapter_routes_total, with the
# base model's pool as `model`: adapters are not labels, so the series stay few): to a replica
# that already ran or queued the adapter, to one with a free adapter slot, or to a full one.
AffinityLabel = Literal["active", "free_slot", "full"]
AFFINITY_LABELS: tuple[AffinityLabel, ...] = get_args(AffinityLabel)
# The status a replica's zero series of requests_total carries (the "Requests/s" panels sum it).
_OK_STATUS = "200"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        model, per_replica = ["model"], ["model", "replica"]

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, model, buckets=_LATENCY_BUCKETS_S, registry=r)

        self.requests = Counter(
            REQUESTS_TOTAL,
            "Requests answered, by model, replica and HTTP status.",
            ["model", "replica", "status"],
            registry=r,
        )
        self.duration = latency(
            REQUEST_DURATION_SECONDS, "Time from request arrival to the last response byte."
        )
        self.ttfb = latency(
            TIME_TO_FIRST_BYTE_SECONDS, "Time from request arrival to the first byte from a replica."
        )
        self.queue_length = Gauge(QUEUE_LENGTH, "Requests waiting in the gateway queue.", model, registry=r)
        self.queue_wait = latency(QUEUE_WAIT_SECONDS, "Time requests spent in the gateway queue.")
        self.retries = Counter(
            RETRIES_TOTAL,
            "Requests retried on another replica (the same one when no other is left).",
            ["model", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            EJECTIONS_TOTAL, "Replica ejections after repeated failures.", ["replica"], registry=r
        )
        self.replica_score = Gauge(
            REPLICA_SCORE, "The kv-aware cost of each replica (lower is better).", per_replica, registry=r
        )
        self.replica_healthy = Gauge(
            REPLICA_HEALTHY,
            "1 while a replica is healthy; 0 while it is ejected, failing (a model's last replica stays "
            "in rotation but counts) or serving other model names than its requests carry.",
            per_replica,
            registry=r,
        )
        self.replica_inflight = Gauge(
            REPLICA_INFLIGHT, "Requests this gateway is proxying to each replica.", per_replica, registry=r
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
            model,
            registry=r,
        )

        self.key_tokens = Counter(
            KEY_TOKENS_TOTAL,
            "Tokens the responses to each API key reported, by key name, model and kind "
            "(prompt, completion); only responses that report usage count.",
            ["key", "model", "kind"],
            registry=r,
        )

        self.overhead = Histogram(
            OVERHEAD_SECONDS,
            "The gateway's own time on a request, by part: request (arrival to sent upstream, less "
            "queueing and failed attempts), first_byte and stream (a replica's bytes in hand to sent "
            "to the client; stream: the mean over a stream's later chunks).",
            ["model", "part"],
            buckets=_OVERHEAD_BUCKETS_S,
            registry=r,
        )
        self.adapter_routes = Counter(
            ADAPTER_ROUTES_TOTAL,
            "LoRA adapter requests routed, by base model and where the adapter stood on the replica "
            "picked: active (running or queued there), free_slot, or full.",
            ["model", "affinity"],
            registry=r,
        )
        self.loop_lag = Histogram(
            EVENT_LOOP_LAG_SECONDS,
            "How late the gateway's event loop woke a task sleeping 50 ms at a time: while it is "
            "late, every request, stream and timer in the process waits.",
            buckets=_LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        r.register(GcPauseCollector(GC_PAUSE_SECONDS))
        # The statuses each replica's requests_total has series for, to remove them with it.
        self._replica_statuses: dict[tuple[str, str], set[str]] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def add_model(self, model: str) -> None:
        """Zero series for a model's per-model metrics (labels() creates a child at zero)."""
        for histogram in (self.duration, self.ttfb, self.queue_wait):
            histogram.labels(model)
        self.queue_length.labels(model)
        self.streams_broken.labels(model)
        for reason in RETRY_REASONS:
            self.retries.labels(model, reason)
        for part in OVERHEAD_PARTS:
            self.overhead.labels(model, part)

    def add_adapter_pool(self, model: str) -> None:
        """Zero series of adapter_routes_total for a pool serving adapters, one per affinity tier."""
        for tier in AFFINITY_LABELS:
            self.adapter_routes.labels(model, tier)

    def count_request(self, model: str, replica: str, status: str) -> None:
        """One answered request; `replica` is "" for the gateway's own answers."""
        self.requests.labels(model, replica, status).inc()
        if replica:
            self._replica_statuses.setdefault((model, replica), set()).add(status)

    def add_replica(self, model: str, url: str) -> None:
        """Zero series for a replica's counters. Its gauges are set by Fleet.update_gauges, since
        a made-up 0 there would read as "ejected" or "idle"."""
        self.requests.labels(model, url, _OK_STATUS)
        self._replica_statuses.setdefault((model, url), set()).add(_OK_STATUS)
        self.ejections.labels(url)

    def forget_replica(self, model: str, url: str, is_url_gone: bool) -> None:
        """Remove a replica's series (it left discovery); `ejections_total`, labelled by URL alone,
        once no model is served at that URL any more."""
        for gauge in (self.replica_score, self.replica_healthy, self.replica_inflight):
            gauge.remove(model, url)
        for status in self._replica_statuses.pop((model, url), set()):
            self.requests.remove(model, url, status)
        if is_url_gone:
            self.ejections.remove(url)
