"""The deployment dashboard's rows on the serving processes themselves: time in Python's garbage
collector, each gateway's event-loop lag, and resident memory, of each engine and each gateway."""

from __future__ import annotations

from corral_engine import wire
from corral_gateway import metrics as gw

from corral_cli.chartgen.dashboards.panels import ENGINE_MODEL, MODEL_VAR, REPLICA, engine, gateway
from corral_cli.chartgen.grafana import Panel, Row, Target, quantile, rate, sel, sum_by


def collector_row() -> Row:
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


def loop_row() -> Row:
    """How late each gateway's event loop runs, beside the connect timeouts it caused: a connect
    that timed out while the loop stalled is the gateway's, retried but not held against the replica."""
    return Row(
        "Gateway event loop",
        (
            Panel(
                "Event-loop lag per gateway (p50/p99)",
                "How late each gateway's event loop woke a task due every 50 ms: while it is late, "
                "every request and stream through that gateway waits (a burst of hundreds of new "
                "connections on a saturated machine stalled it 0.5-5 s).",
                tuple(
                    Target(
                        quantile(q, gw.EVENT_LOOP_LAG_SECONDS, REPLICA), f"{{{{instance}}}} p{round(q * 100)}"
                    )
                    for q in (0.5, 0.99)
                ),
                unit="s",
            ),
            Panel(
                "Connect timeouts by cause",
                "Connects to the model's replicas that timed out: connect_timeout (the replica did not "
                "answer; counts towards ejecting it) or connect_timeout_loop_stall (the gateway's own "
                "loop stalled over the timeout; retried, not counted against the replica).",
                (
                    Target(
                        sum_by("reason", rate(gateway(gw.RETRIES_TOTAL, reason="connect_timeout.*"))),
                        "{{reason}}",
                    ),
                ),
                unit="reqps",
            ),
        ),
    )


def memory_row() -> Row:
    """Each serving process's resident memory (prometheus_client's process figures, which every
    Python exporter shares, so a process is picked by a series only it exports, on its instance)."""
    resident = "process_resident_memory_bytes"
    engines = f"{resident} and on ({REPLICA}) {engine(wire.NUM_REQUESTS_RUNNING)}"
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
