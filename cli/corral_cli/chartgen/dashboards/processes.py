"""The deployment dashboard's rows on the serving processes themselves: time in Python's garbage
collector, and resident memory, of each engine and each gateway."""

from __future__ import annotations

from corral_engine import wire
from corral_gateway import metrics as gw

from corral_cli.chartgen.dashboards.panels import ENGINE_MODEL, MODEL_VAR, REPLICA, engine
from corral_cli.chartgen.grafana import Panel, Row, Target, rate, sel, sum_by


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
