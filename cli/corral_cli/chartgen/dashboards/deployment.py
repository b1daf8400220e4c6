"""The deployment dashboard: one served model, chosen with the `model` variable; each replica's load,
latency and cache, request phases, the gateway's view, LoRA adapters, and the serving processes'
collector, event loop and memory."""

from __future__ import annotations

from corral_engine import wire
from corral_gateway import metrics as gw

from corral_cli.chartgen.dashboards.adapters import adapters_row
from corral_cli.chartgen.dashboards.panels import (
    ENGINE_MODEL,
    GATEWAY_MODEL,
    MODEL_VAR,
    MODEL_VARIABLE_QUERY,
    REPLICA,
    engine,
    gateway,
    hit_rate,
    quantiles,
)
from corral_cli.chartgen.dashboards.phases import phases_row
from corral_cli.chartgen.dashboards.processes import collector_row, loop_row, memory_row
from corral_cli.chartgen.grafana import (
    Dashboard,
    Panel,
    Row,
    Target,
    Variable,
    increase,
    max_by,
    quantile,
    rate,
    sum_by,
)


def deployment_drilldown() -> Dashboard:
    """One model: its replicas, their latency, request phases, the gateway's view, the processes."""
    return Dashboard(
        uid="corral-deployment",
        title="Corral / Deployment",
        description="One served model: each replica's load, latency and cache, and the gateway's view.",
        rows=(
            _replicas_row(),
            _latency_row(),
            phases_row(),
            _gateway_row(),
            adapters_row(),
            collector_row(),
            loop_row(),
            memory_row(),
        ),
        variables=(Variable("model", "Model", MODEL_VARIABLE_QUERY),),
    )


def _replicas_row() -> Row:
    """Each engine replica's running and waiting requests, KV-cache usage, tokens, preemptions and
    prefix-cache hits."""
    r = REPLICA
    return Row(
        "Replicas",
        (
            Panel(
                "Running and waiting per replica",
                "Requests being generated and waiting to be scheduled, per engine replica.",
                (
                    Target(sum_by(r, engine(wire.NUM_REQUESTS_RUNNING)), "{{instance}} running"),
                    Target(sum_by(r, engine(wire.NUM_REQUESTS_WAITING)), "{{instance}} waiting"),
                ),
            ),
            Panel(
                "KV-cache usage per replica",
                "Fraction of each replica's KV cache in use.",
                (Target(max_by(r, engine(wire.KV_CACHE_USAGE_PERC)), "{{instance}}"),),
                unit="percentunit",
                max_value=1.0,
            ),
            Panel(
                "Generated tokens/s per replica",
                "Decode throughput of each replica.",
                (Target(sum_by(r, rate(engine(wire.GENERATION_TOKENS_TOTAL))), "{{instance}}"),),
                width=8,
            ),
            Panel(
                "Preemptions/s per replica",
                "Running requests preempted for lack of KV blocks.",
                (Target(sum_by(r, rate(engine(wire.NUM_PREEMPTIONS_TOTAL))), "{{instance}}"),),
                width=8,
            ),
            Panel(
                "Prefix-cache hit rate per replica",
                "Share of prompt tokens found cached; prefix-affinity routing raises it.",
                (Target(hit_rate(r), "{{instance}}"),),
                unit="percentunit",
                width=8,
                max_value=1.0,
            ),
        ),
    )


def _latency_row() -> Row:
    """Each replica's latency percentiles, queue time and step time; the model's end-to-end latency."""
    r = REPLICA
    return Row(
        "Latency per replica",
        (
            Panel(
                "Time to first token per replica",
                "p50 and p99 per engine replica.",
                quantiles(wire.TIME_TO_FIRST_TOKEN_SECONDS, r, "{{instance}}"),
                unit="s",
            ),
            Panel(
                "Time per output token per replica",
                "Inter-token latency p50 and p99 per engine replica.",
                quantiles(wire.INTER_TOKEN_LATENCY_SECONDS, r, "{{instance}}"),
                unit="s",
            ),
            Panel(
                "Engine queue time per replica",
                "Arrival to first scheduled step inside the engine (p50, p99).",
                quantiles(wire.REQUEST_QUEUE_TIME_SECONDS, r, "{{instance}}"),
                unit="s",
                width=8,
            ),
            Panel(
                "End-to-end request latency",
                "Arrival to finish inside the engines (p50, p99).",
                quantiles(wire.E2E_REQUEST_LATENCY_SECONDS, ENGINE_MODEL, "{{model_name}}"),
                unit="s",
                width=8,
            ),
            Panel(
                "Engine step duration per replica",
                "Wall time of one engine step (p99): schedule, forward, sample, detokenize.",
                (
                    Target(
                        quantile(0.99, wire.STEP_DURATION_SECONDS, r, **{ENGINE_MODEL: MODEL_VAR}),
                        "{{instance}}",
                    ),
                ),
                unit="s",
                width=8,
            ),
        ),
    )


def _gateway_row() -> Row:
    """The gateway's view of the model (each replica's requests, score and in-flight count, its queue),
    engine refusals, and the gateway's own latency and overhead."""
    return Row(
        "Gateway view of the model",
        (
            Panel(
                "Requests/s per replica and status",
                "What the gateway sent to each replica, by HTTP status.",
                (
                    Target(
                        sum_by("replica, status", rate(gateway(gw.REQUESTS_TOTAL))), "{{replica}} {{status}}"
                    ),
                ),
                unit="reqps",
                width=8,
            ),
            Panel(
                "Replica score and in-flight requests",
                "Each replica's kv-aware cost (lower is better) and requests in flight through the gateway.",
                (
                    Target(max_by("replica", gateway(gw.REPLICA_SCORE)), "{{replica}} score"),
                    Target(sum_by("replica", gateway(gw.REPLICA_INFLIGHT)), "{{replica}} in flight"),
                ),
                width=8,
            ),
            Panel(
                "Gateway queue",
                "Requests held at the gateway and how long they waited (p99).",
                (
                    Target(sum_by(GATEWAY_MODEL, gateway(gw.QUEUE_LENGTH)), "{{model}} queued"),
                    Target(
                        quantile(0.99, gw.QUEUE_WAIT_SECONDS, GATEWAY_MODEL, **{GATEWAY_MODEL: MODEL_VAR}),
                        "{{model}} wait p99",
                    ),
                ),
                width=8,
            ),
            Panel(
                "Engine refusals by reason",
                "Requests an engine refused before scheduling them (queue full, invalid, ...).",
                (
                    Target(
                        sum_by(f"{ENGINE_MODEL}, reason", increase(engine(wire.NUM_REQUESTS_REJECTED_TOTAL))),
                        "{{reason}}",
                    ),
                ),
                width=8,
            ),
            *_gateway_time_panels(),
        ),
    )


def _gateway_time_panels() -> tuple[Panel, Panel]:
    """The gateway's latency for the model, and its own overhead in it."""
    return (
        Panel(
            "Gateway latency",
            "Arrival at the gateway to the last response byte (p50, p99).",
            quantiles(gw.REQUEST_DURATION_SECONDS, GATEWAY_MODEL, "{{model}}", is_gateway=True),
            unit="s",
            width=8,
        ),
        Panel(
            "Gateway overhead (p50/p99 by part)",
            "The gateway's own time on a request, timed inside it: request (arrival to sent to the "
            "replica, less queueing and failed attempts), first_byte and stream (a replica's bytes "
            "in hand to sent to the client; stream: the mean over a stream's later chunks).",
            quantiles(gw.OVERHEAD_SECONDS, f"{GATEWAY_MODEL}, part", "{{part}}", is_gateway=True),
            unit="s",
            width=8,
        ),
    )
