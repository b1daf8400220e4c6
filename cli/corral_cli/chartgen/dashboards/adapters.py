"""The dashboards' LoRA adapter panels: each replica's adapter slots and the adapters it runs and
queues (vLLM's `vllm:lora_requests_info`), and where the gateway's LoRA affinity sent adapter
requests (`corral_gateway_adapter_routes_total`). Without LoRA they have no series."""

from __future__ import annotations

from corral_engine import wire
from corral_gateway import metrics as gw

from corral_cli.chartgen.dashboards.panels import GATEWAY_MODEL, REPLICA, engine, gateway
from corral_cli.chartgen.grafana import Panel, Row, Target, max_by, rate, sum_by

NO_LORA = "No LoRA: no engine runs with --enable-lora"
NO_ADAPTER_REQUESTS = "No adapter requests yet"
AFFINITY = "affinity"


def lora_state() -> str:
    """Each replica's latest LoRA state, valued at its change in Unix milliseconds (Grafana's time
    unit); an empty adapter list reads `none`, since Prometheus drops labels with empty values."""
    # The gauge has no model label (as in vLLM): a replica's model is that of its request gauge.
    info = f"{wire.LORA_REQUESTS_INFO} and on ({REPLICA}) {engine(wire.NUM_REQUESTS_RUNNING)}"
    labels = (REPLICA, wire.LORA_MAX_LABEL, wire.LORA_RUNNING_LABEL, wire.LORA_WAITING_LABEL)
    expr = f"1000 * {max_by(', '.join(labels), info)}"
    for label in (wire.LORA_RUNNING_LABEL, wire.LORA_WAITING_LABEL):
        expr = f'label_replace({expr}, "{label}", "none", "{label}", "")'
    return expr


def adapter_routes(by: str, **matchers: str) -> str:
    return sum_by(by, rate(gateway(gw.ADAPTER_ROUTES_TOTAL, **matchers)))


def active_share() -> str:
    """Per model, the share of adapter requests routed to a replica already running or queueing
    their adapter (no adapter to swap in); none without adapter requests (the gateway's zero
    series would make it 0/0, NaN, which Grafana shows as a value)."""
    active = adapter_routes(GATEWAY_MODEL, **{AFFINITY: '="active"'})
    return f"{active} / ({adapter_routes(GATEWAY_MODEL)} > 0)"


def active_share_panel(width: int) -> Panel:
    return Panel(
        "Adapter requests finding their adapter active",
        "Share of adapter requests the gateway sent to a replica already running or queueing their "
        "adapter; the rest make a replica load it into a free slot, or wait for one.",
        (Target(active_share(), "{{model}}"),),
        unit="percentunit",
        width=width,
        max_value=1.0,
        is_event_driven=True,
        no_value=NO_ADAPTER_REQUESTS,
    )


def adapters_row() -> Row:
    """Deployment view: each replica's adapter slots and adapters, and the gateway's routing of
    adapter requests by affinity."""
    return Row(
        "LoRA adapters",
        (
            Panel(
                "Adapters per replica",
                "Each replica's latest LoRA state: the adapters one step may run (max_lora), those "
                "of its running and its waiting requests, and when that last changed.",
                (Target(lora_state(), "{{instance}}"),),
                unit="dateTimeFromNow",
                kind="table",
                is_event_driven=True,
                no_value=NO_LORA,
                columns=(
                    (REPLICA, "Replica"),
                    (wire.LORA_MAX_LABEL, "Max adapters"),
                    (wire.LORA_RUNNING_LABEL, "Running"),
                    (wire.LORA_WAITING_LABEL, "Waiting"),
                    ("Value", "Changed"),
                ),
            ),
            Panel(
                "Adapter requests/s by affinity",
                "Where the gateway sent adapter requests: active (a replica running or queueing the "
                "adapter), free_slot (one with room to load it), full (every slot taken: it waits).",
                (Target(adapter_routes(AFFINITY), "{{affinity}}"),),
                unit="reqps",
                width=6,
                is_event_driven=True,
                no_value=NO_ADAPTER_REQUESTS,
            ),
            active_share_panel(width=6),
        ),
    )


def fleet_adapters_row() -> Row:
    """Fleet view: adapter requests a second and how often they found their adapter active."""
    return Row(
        "LoRA adapters",
        (
            Panel(
                "Adapter requests/s by model",
                "Requests for a LoRA adapter, by base model.",
                (Target(adapter_routes(GATEWAY_MODEL), "{{model}}"),),
                unit="reqps",
                is_event_driven=True,
                no_value=NO_ADAPTER_REQUESTS,
            ),
            active_share_panel(width=12),
        ),
    )
