"""The two Corral dashboards: a fleet overview and a per-deployment drill-down.

Every metric name comes from the engine's wire contract (vLLM names) or the gateway's metrics
module, never spelled here, so a renamed metric breaks the generator rather than a dashboard.
"""

from __future__ import annotations

from corral_engine import wire
from corral_gateway import metrics as gw

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
    sel,
    sum_by,
)

MODEL_VAR = "$model"
ENGINE_MODEL = wire.MODEL_NAME_LABEL  # engines label series model_name=...
GATEWAY_MODEL = "model"  # the gateway labels series model=...
# Engine replicas are told apart by the scrape target (pod IP:port on Kubernetes, host:port locally).
REPLICA = "instance"
MODEL_VARIABLE_QUERY = f"label_values({wire.NUM_REQUESTS_RUNNING}, {ENGINE_MODEL})"


def _engine(metric: str, **extra: str) -> str:
    return sel(metric, **{ENGINE_MODEL: MODEL_VAR}, **extra)


def _gateway(metric: str, **extra: str) -> str:
    return sel(metric, **{GATEWAY_MODEL: MODEL_VAR}, **extra)


def _quantiles(histogram: str, by: str, legend: str, *, is_gateway: bool = False) -> tuple[Target, ...]:
    label = GATEWAY_MODEL if is_gateway else ENGINE_MODEL
    return tuple(
        Target(quantile(q, histogram, by, **{label: MODEL_VAR}), f"{legend} p{round(q * 100)}")
        for q in (0.5, 0.99)
    )


def _hit_rate(by: str) -> str:
    hits = sum_by(by, rate(_engine(wire.PREFIX_CACHE_HITS_TOTAL)))
    queries = sum_by(by, rate(_engine(wire.PREFIX_CACHE_QUERIES_TOTAL)))
    return f"{hits} / {queries}"


def _ratio(numerator: str, denominator: str, by: str) -> str:
    return f"{sum_by(by, rate(_engine(numerator)))} / {sum_by(by, rate(_engine(denominator)))}"


def _phases_row() -> Row:
    """Where a request's engine time goes, and what speculative decoding saves (deployment view)."""
    r, m = REPLICA, ENGINE_MODEL
    iteration = wire.ITERATION_TOKENS_TOTAL
    return Row(
        "Request phases and speculative decoding",
        (
            Panel(
                "Prefill and decode time",
                "Per request: first scheduled to first token (prefill), first to last token (decode); "
                "p50 and p99.",
                _quantiles(wire.REQUEST_PREFILL_TIME_SECONDS, m, "prefill")
                + _quantiles(wire.REQUEST_DECODE_TIME_SECONDS, m, "decode"),
                unit="s",
                width=8,
            ),
            Panel(
                "Time per output token per request",
                "Each request's decode time over its output tokens after the first (p50, p99).",
                _quantiles(wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS, r, "{{instance}}"),
                unit="s",
                width=8,
            ),
            Panel(
                "Tokens per engine step",
                "Mean tokens computed per step (prompt chunks, decodes and drafts): how full batches are.",
                (Target(_ratio(iteration + "_sum", iteration + "_count", r), "{{instance}}"),),
                width=8,
            ),
            Panel(
                "Speculative draft acceptance",
                "Share of n-gram draft tokens the model accepted (no data without --speculative).",
                (
                    Target(
                        _ratio(
                            wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL,
                            wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL,
                            r,
                        ),
                        "{{instance}}",
                    ),
                ),
                unit="percentunit",
                max_value=1.0,
                width=6,
                is_event_driven=True,
            ),
            *_acceptance_panels(),
            Panel(
                "Speculative drafts/s",
                "Draft tokens verified and accepted per second.",
                (
                    Target(
                        sum_by(r, rate(_engine(wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL))),
                        "{{instance}} drafted",
                    ),
                    Target(
                        sum_by(r, rate(_engine(wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL))),
                        "{{instance}} accepted",
                    ),
                ),
                width=6,
            ),
        ),
    )


def _acceptance_panels() -> tuple[Panel, Panel]:
    """Mean acceptance length and acceptance rate by draft position, per model, as vLLM defines them."""
    m = ENGINE_MODEL
    drafts = sum_by(m, rate(_engine(wire.SPEC_DECODE_NUM_DRAFTS_TOTAL)))
    accepted = sum_by(m, rate(_engine(wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL)))
    per_pos = sum_by(f"{m}, position", rate(_engine(wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL)))
    return (
        Panel(
            "Mean acceptance length",
            "Tokens a verified draft yields: 1 + accepted tokens / drafts (NaN without --speculative).",
            (Target(f"1 + {accepted} / {drafts}", "{{model_name}}"),),
            width=6,
            is_event_driven=True,
        ),
        Panel(
            "Acceptance rate by draft position",
            "Share of drafts whose token at this position was accepted (0 = first; no series without "
            "--speculative).",
            # group_left: each position's rate over its model's one drafts rate.
            (Target(f"{per_pos} / on ({m}) group_left {drafts}", "{{model_name}} position {{position}}"),),
            unit="percentunit",
            max_value=1.0,
            width=6,
            is_event_driven=True,
        ),
    )


def fleet_overview() -> Dashboard:
    m = ENGINE_MODEL
    traffic = Row(
        "Traffic",
        (
            Panel(
                "Requests/s by model",
                "Requests answered by the gateway, per model.",
                (Target(sum_by(GATEWAY_MODEL, rate(_gateway(gw.REQUESTS_TOTAL))), "{{model}}"),),
                unit="reqps",
                width=8,
            ),
            Panel(
                "Errors/s by model",
                "Gateway answers with a non-2xx status (client mistakes, overload, replica failures).",
                (
                    Target(
                        sum_by(
                            f"{GATEWAY_MODEL}, status", rate(_gateway(gw.REQUESTS_TOTAL, status='!~"2.."'))
                        ),
                        "{{model}} {{status}}",
                    ),
                ),
                unit="reqps",
                width=8,
                is_event_driven=True,
            ),
            Panel(
                "Tokens/s by model",
                "Prompt tokens processed and tokens generated by the engines.",
                (
                    Target(
                        sum_by(m, rate(_engine(wire.GENERATION_TOKENS_TOTAL))), "{{model_name}} generated"
                    ),
                    Target(sum_by(m, rate(_engine(wire.PROMPT_TOKENS_TOTAL))), "{{model_name}} prompt"),
                ),
                width=8,
            ),
        ),
    )
    latency = Row(
        "Latency",
        (
            Panel(
                "Time to first token",
                "Engine-side time from arrival to the first generated token (p50, p99).",
                _quantiles(wire.TIME_TO_FIRST_TOKEN_SECONDS, m, "{{model_name}}"),
                unit="s",
                width=8,
            ),
            Panel(
                "Time per output token",
                "Inter-token latency of streaming generations (p50, p99).",
                _quantiles(wire.INTER_TOKEN_LATENCY_SECONDS, m, "{{model_name}}"),
                unit="s",
                width=8,
            ),
            Panel(
                "Gateway time to first byte",
                "From request arrival at the gateway to the first byte from a replica, queueing included.",
                _quantiles(gw.TIME_TO_FIRST_BYTE_SECONDS, GATEWAY_MODEL, "{{model}}", is_gateway=True),
                unit="s",
                width=8,
            ),
        ),
    )
    healthy = _gateway(gw.REPLICA_HEALTHY)
    capacity = Row(
        "Capacity and load",
        (
            Panel(
                "Replicas per model",
                "Engine replicas Prometheus scrapes, and replicas the gateway sees healthy (in rotation, "
                "answering, serving the model's name).",
                (
                    Target(
                        f"count by ({m}) ({_engine(wire.NUM_REQUESTS_RUNNING)})", "{{model_name}} engines"
                    ),
                    Target(
                        # Every gateway replica exports each engine replica's gauge: one per replica.
                        sum_by(GATEWAY_MODEL, f"max by ({GATEWAY_MODEL}, replica) ({healthy})"),
                        "{{model}} healthy at the gateway",
                    ),
                ),
                width=8,
            ),
            Panel(
                "Queue at the gateway and the engines",
                "Requests held by the gateway while every replica is saturated, and waiting in engines.",
                (
                    Target(sum_by(GATEWAY_MODEL, _gateway(gw.QUEUE_LENGTH)), "{{model}} gateway queue"),
                    Target(sum_by(m, _engine(wire.NUM_REQUESTS_WAITING)), "{{model_name}} engines waiting"),
                    Target(sum_by(m, _engine(wire.NUM_REQUESTS_RUNNING)), "{{model_name}} engines running"),
                ),
                width=8,
            ),
            Panel(
                "KV-cache usage per replica",
                "Fraction of each replica's KV cache in use; above 0.8 a replica counts as saturated.",
                (Target(max_by(f"{m}, {REPLICA}", _engine(wire.KV_CACHE_USAGE_PERC)), "{{instance}}"),),
                unit="percentunit",
                width=8,
                max_value=1.0,
            ),
            Panel(
                "Preemptions/s",
                "Running requests preempted for lack of KV blocks (they resume later).",
                (Target(sum_by(m, rate(_engine(wire.NUM_PREEMPTIONS_TOTAL))), "{{model_name}}"),),
                width=12,
            ),
            Panel(
                "Prefix-cache hit rate",
                "Share of prompt tokens found in the engines' prefix cache.",
                (Target(_hit_rate(m), "{{model_name}}"),),
                unit="percentunit",
                width=12,
                max_value=1.0,
            ),
        ),
    )
    resilience = Row(
        "Gateway resilience",
        (
            Panel(
                "Retries/s by reason",
                "Requests the gateway retried on another replica before the first byte.",
                (
                    Target(
                        sum_by(f"{GATEWAY_MODEL}, reason", rate(_gateway(gw.RETRIES_TOTAL))),
                        "{{model}} {{reason}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Replica ejections",
                "Replicas taken out of rotation after repeated failures (probed back later).",
                (Target(sum_by("replica", increase(gw.EJECTIONS_TOTAL)), "{{replica}}"),),
            ),
            Panel(
                "Tokens/s by API key",
                "Prompt and completion tokens the gateway's responses reported, by API key name "
                "(only with a keys file; streams without include_usage report none).",
                (Target(sum_by("key, kind", rate(_gateway(gw.KEY_TOKENS_TOTAL))), "{{key}} {{kind}}"),),
                width=24,
                is_event_driven=True,
            ),
        ),
    )
    return Dashboard(
        uid="corral-fleet",
        title="Corral / Fleet overview",
        description="Every model served by Corral: traffic, latency, capacity and gateway resilience.",
        rows=(traffic, latency, capacity, resilience),
        variables=(Variable("model", "Model", MODEL_VARIABLE_QUERY, is_multi=True, include_all=True),),
    )


def deployment_drilldown() -> Dashboard:
    r = REPLICA
    per_replica_load = Row(
        "Replicas",
        (
            Panel(
                "Running and waiting per replica",
                "Requests being generated and waiting to be scheduled, per engine replica.",
                (
                    Target(sum_by(r, _engine(wire.NUM_REQUESTS_RUNNING)), "{{instance}} running"),
                    Target(sum_by(r, _engine(wire.NUM_REQUESTS_WAITING)), "{{instance}} waiting"),
                ),
            ),
            Panel(
                "KV-cache usage per replica",
                "Fraction of each replica's KV cache in use.",
                (Target(max_by(r, _engine(wire.KV_CACHE_USAGE_PERC)), "{{instance}}"),),
                unit="percentunit",
                max_value=1.0,
            ),
            Panel(
                "Generated tokens/s per replica",
                "Decode throughput of each replica.",
                (Target(sum_by(r, rate(_engine(wire.GENERATION_TOKENS_TOTAL))), "{{instance}}"),),
                width=8,
            ),
            Panel(
                "Preemptions/s per replica",
                "Running requests preempted for lack of KV blocks.",
                (Target(sum_by(r, rate(_engine(wire.NUM_PREEMPTIONS_TOTAL))), "{{instance}}"),),
                width=8,
            ),
            Panel(
                "Prefix-cache hit rate per replica",
                "Share of prompt tokens found cached; prefix-affinity routing raises it.",
                (Target(_hit_rate(r), "{{instance}}"),),
                unit="percentunit",
                width=8,
                max_value=1.0,
            ),
        ),
    )
    latency = Row(
        "Latency per replica",
        (
            Panel(
                "Time to first token per replica",
                "p50 and p99 per engine replica.",
                _quantiles(wire.TIME_TO_FIRST_TOKEN_SECONDS, r, "{{instance}}"),
                unit="s",
            ),
            Panel(
                "Time per output token per replica",
                "Inter-token latency p50 and p99 per engine replica.",
                _quantiles(wire.INTER_TOKEN_LATENCY_SECONDS, r, "{{instance}}"),
                unit="s",
            ),
            Panel(
                "Engine queue time per replica",
                "Arrival to first scheduled step inside the engine (p50, p99).",
                _quantiles(wire.REQUEST_QUEUE_TIME_SECONDS, r, "{{instance}}"),
                unit="s",
                width=8,
            ),
            Panel(
                "End-to-end request latency",
                "Arrival to finish inside the engines (p50, p99).",
                _quantiles(wire.E2E_REQUEST_LATENCY_SECONDS, ENGINE_MODEL, "{{model_name}}"),
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
    gateway = Row(
        "Gateway view of the model",
        (
            Panel(
                "Requests/s per replica and status",
                "What the gateway sent to each replica, by HTTP status.",
                (
                    Target(
                        sum_by("replica, status", rate(_gateway(gw.REQUESTS_TOTAL))), "{{replica}} {{status}}"
                    ),
                ),
                unit="reqps",
                width=8,
            ),
            Panel(
                "Replica score and in-flight requests",
                "Each replica's kv-aware cost (lower is better) and requests in flight through the gateway.",
                (
                    Target(max_by("replica", _gateway(gw.REPLICA_SCORE)), "{{replica}} score"),
                    Target(sum_by("replica", _gateway(gw.REPLICA_INFLIGHT)), "{{replica}} in flight"),
                ),
                width=8,
            ),
            Panel(
                "Gateway queue",
                "Requests held at the gateway and how long they waited (p99).",
                (
                    Target(sum_by(GATEWAY_MODEL, _gateway(gw.QUEUE_LENGTH)), "{{model}} queued"),
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
                        sum_by(
                            f"{ENGINE_MODEL}, reason", increase(_engine(wire.NUM_REQUESTS_REJECTED_TOTAL))
                        ),
                        "{{reason}}",
                    ),
                ),
                width=8,
            ),
            Panel(
                "Gateway latency",
                "Arrival at the gateway to the last response byte (p50, p99).",
                _quantiles(gw.REQUEST_DURATION_SECONDS, GATEWAY_MODEL, "{{model}}", is_gateway=True),
                unit="s",
                width=8,
            ),
            Panel(
                "Gateway overhead (p50/p99 by part)",
                "The gateway's own time on a request, timed inside it: request (arrival to sent to the "
                "replica, less queueing and failed attempts), first_byte and stream (a replica's bytes "
                "in hand to sent to the client; stream: the mean over a stream's later chunks).",
                _quantiles(gw.OVERHEAD_SECONDS, f"{GATEWAY_MODEL}, part", "{{part}}", is_gateway=True),
                unit="s",
                width=8,
            ),
        ),
    )
    return Dashboard(
        uid="corral-deployment",
        title="Corral / Deployment",
        description="One served model: each replica's load, latency and cache, and the gateway's view.",
        rows=(per_replica_load, latency, _phases_row(), gateway, _collector_row(), _memory_row()),
        variables=(Variable("model", "Model", MODEL_VARIABLE_QUERY),),
    )


def _collector_row() -> Row:
    """Python's garbage-collector passes in each serving process, as the share of time they took:
    a pass stops every thread (an engine's steps and streams, every stream through a gateway)."""

    def share(histogram: str, legend: str, **matchers: str) -> tuple[Target, ...]:
        def of(**generation: str) -> str:
            return sum_by(REPLICA, rate(sel(f"{histogram}_sum", **matchers, **generation)))

        return (Target(of(), f"{legend} all passes"), Target(of(generation='="2"'), f"{legend} full passes"))

    return Row(
        "Garbage collector",
        (
            Panel(
                "Collector pauses per replica",
                "Share of each engine's time spent in Python's collector passes, during which its steps "
                "and streams all wait; full passes grow with the requests it holds open.",
                share(wire.GC_PAUSE_SECONDS, "{{instance}}", **{ENGINE_MODEL: MODEL_VAR}),
                unit="percentunit",
            ),
            Panel(
                "Collector pauses per gateway",
                "Share of each gateway process's time spent in collector passes (all models: a gateway "
                "serves every model), during which every stream through it waits.",
                share(gw.GC_PAUSE_SECONDS, "{{instance}}"),
                unit="percentunit",
            ),
        ),
    )


def _memory_row() -> Row:
    """Each serving process's resident memory (prometheus_client's process figures, which every
    Python exporter shares, so a process is picked by a series only it exports, on its instance)."""
    resident = "process_resident_memory_bytes"
    engines = f"{resident} and on ({REPLICA}) {_engine(wire.NUM_REQUESTS_RUNNING)}"
    gateways = f"{resident} and on ({REPLICA}) {sum_by(REPLICA, gw.GC_PAUSE_SECONDS + '_count')}"
    return Row(
        "Memory",
        (
            Panel(
                "Resident memory per replica",
                "Each engine's serving process's resident memory. On CPU it climbs most over its "
                "first thousands of steps (oneDNN compiles and keeps a kernel for each batch size it "
                "meets), then slowly; a climb that keeps its pace is a leak (docs/operations.md).",
                (Target(engines, "{{instance}}"),),
                unit="bytes",
            ),
            Panel(
                "Resident memory per gateway",
                "Each gateway process's resident memory (all models). It grows while its prefix index "
                "fills, then holds.",
                (Target(gateways, "{{instance}}"),),
                unit="bytes",
            ),
        ),
    )


# file name under charts/corral/dashboards/ -> dashboard
DASHBOARDS = {
    "corral-fleet.json": fleet_overview,
    "corral-deployment.json": deployment_drilldown,
}
