"""Shared pieces of the dashboards' panels: the label names and the model variable, and PromQL builders
for engine and gateway series filtered to the selected models.

Every metric name comes from the engine's wire contract (vLLM names) or the gateway's metrics
module, never spelled here, so a renamed metric breaks the generator rather than a dashboard.
"""

from __future__ import annotations

from corral_engine import wire

from corral_cli.chartgen.grafana import Target, quantile, rate, sel, sum_by

MODEL_VAR = "$model"
ENGINE_MODEL = wire.MODEL_NAME_LABEL  # engines label series model_name=...
GATEWAY_MODEL = "model"  # the gateway labels series model=...
# Engine replicas are told apart by the scrape target (pod IP:port on Kubernetes, host:port locally).
REPLICA = "instance"
MODEL_VARIABLE_QUERY = f"label_values({wire.NUM_REQUESTS_RUNNING}, {ENGINE_MODEL})"


def engine(metric: str, **extra: str) -> str:
    return sel(metric, **{ENGINE_MODEL: MODEL_VAR}, **extra)


def gateway(metric: str, **extra: str) -> str:
    return sel(metric, **{GATEWAY_MODEL: MODEL_VAR}, **extra)


def quantiles(histogram: str, by: str, legend: str, *, is_gateway: bool = False) -> tuple[Target, ...]:
    label = GATEWAY_MODEL if is_gateway else ENGINE_MODEL
    return tuple(
        Target(quantile(q, histogram, by, **{label: MODEL_VAR}), f"{legend} p{round(q * 100)}")
        for q in (0.5, 0.99)
    )


def hit_rate(by: str) -> str:
    hits = sum_by(by, rate(engine(wire.PREFIX_CACHE_HITS_TOTAL)))
    queries = sum_by(by, rate(engine(wire.PREFIX_CACHE_QUERIES_TOTAL)))
    return f"{hits} / {queries}"


def ratio(numerator: str, denominator: str, by: str) -> str:
    return f"{sum_by(by, rate(engine(numerator)))} / {sum_by(by, rate(engine(denominator)))}"
