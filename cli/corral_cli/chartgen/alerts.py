"""Corral's Prometheus alerts, written twice from one definition: the chart's PrometheusRule template
(thresholds from values.yaml) and a plain rules file with the default thresholds, which
`promtool test rules` unit-tests and the dashboards e2e loads into a real Prometheus.

Every metric name comes from the engine's wire contract, the gateway's or the operator's metrics
module. Each alert's runbook is a section of docs/operations.md named after it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from corral_engine import wire
from corral_gateway import metrics as gw
from corral_operator import telemetry as op

from corral_cli.chartgen.values import RUNBOOK_BASE_URL, Alerts

GROUP = "corral"
RATE = "5m"
M = wire.MODEL_NAME_LABEL
# Gateway statuses that are the fleet's fault: 5xx and streams a replica broke (not 4xx, not 429).
ERROR_STATUSES = "5..|broken"
SHEDDING_REASONS = "queue_full|queue_timeout"
FULL_SLOTS = '{affinity="full"}'  # adapter requests that found every slot of their replica taken


@dataclass(frozen=True, slots=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self, runbook_base_url: str, escape: Callable[[str], str] = lambda text: text) -> dict[str, Any]:
        """The rule; `escape` is applied to the texts holding Prometheus's own templates (the
        runbook's base may be a Helm expression, which must stay one)."""
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": escape(self.summary),
                "description": escape(self.description),
                # The key Alertmanager's and Grafana's templates link: a runbook section per alert.
                "runbook_url": f"{runbook_base_url}#{self.name.lower()}",
            },
        }


def alerts(t: Mapping[str, str]) -> list[Alert]:
    """The alerts, with each threshold written as `t[name]` (a number, or a Helm expression)."""
    ttft_buckets = f"rate({wire.TIME_TO_FIRST_TOKEN_SECONDS}_bucket[{RATE}])"
    ttft = f"histogram_quantile(0.99, sum by (le, {M}) ({ttft_buckets}))"
    answered = f"sum by (model) (rate({gw.REQUESTS_TOTAL}[{RATE}]))"
    failed = f'sum by (model) (rate({gw.REQUESTS_TOTAL}{{status=~"{ERROR_STATUSES}"}}[{RATE}]))'
    waiting = f"sum by ({M}) ({wire.NUM_REQUESTS_WAITING})"
    growth = f"sum by ({M}) (deriv({wire.NUM_REQUESTS_WAITING}[10m]))"

    def pauses(histogram: str) -> str:
        return f"sum by (job, instance) (rate({histogram}_sum[{RATE}]))"

    def adapter_routes(matchers: str = "") -> str:
        return f"sum by (model) (rate({gw.ADAPTER_ROUTES_TOTAL}{matchers}[{RATE}]))"

    return [
        Alert(
            "CorralEngineDown",
            # Targets that served engine metrics in the last hour and can no longer be scraped.
            f"up == 0 and on (job, instance) max_over_time({wire.NUM_REQUESTS_RUNNING}[1h])",
            "2m",
            "critical",
            "An engine replica is down",
            "Prometheus cannot scrape the engine at {{ $labels.instance }} (job {{ $labels.job }}).",
        ),
        Alert(
            "CorralModelDown",
            # Every gateway sees every replica of the model failing (or serving another name); a
            # model scaled to zero has no replica series, so it is not down.
            f"max by (model) ({gw.REPLICA_HEALTHY}) == 0",
            "2m",
            "critical",
            "No replica of a model is healthy",
            "The gateway sees no healthy replica of {{ $labels.model }}: its requests fail.",
        ),
        Alert(
            "CorralKVCacheFull",
            f"max by ({M}, instance) ({wire.KV_CACHE_USAGE_PERC}) > {t['kvUsageRatio']}",
            "5m",
            "warning",
            "An engine's KV cache is nearly full",
            "{{ $labels.instance }} ({{ $labels.model_name }}) has used {{ $value | humanizePercentage }} "
            "of its KV cache for 5 minutes: requests queue and get preempted.",
        ),
        Alert(
            "CorralQueueGrowing",
            f"{waiting} > {t['queueMinWaiting']} and {growth} > 0",
            "10m",
            "warning",
            "Requests pile up in the engines' queues",
            "{{ $value }} requests of {{ $labels.model_name }} wait in the engines, and more every minute.",
        ),
        Alert(
            "CorralTTFTHigh",
            f"{ttft} > {t['ttftP99SloSeconds']}",
            "10m",
            "warning",
            "Time to first token is over its SLO",
            "p99 time to first token of {{ $labels.model_name }} is {{ $value | humanizeDuration }}.",
        ),
        Alert(
            "CorralErrorRateHigh",
            f"({failed} / {answered}) > {t['errorRatio']}",
            "5m",
            "critical",
            "The gateway answers many requests with errors",
            "{{ $value | humanizePercentage }} of {{ $labels.model }} requests end in a 5xx or a "
            "broken stream.",
        ),
        Alert(
            "CorralGatewayShedding",
            f'sum by (model) (rate({gw.REJECTED_TOTAL}{{reason=~"{SHEDDING_REASONS}"}}[{RATE}])) > 0',
            "5m",
            "warning",
            "The gateway is shedding load",
            "The gateway refuses {{ $value | humanize }} requests/s of {{ $labels.model }} because its queue "
            "is full or requests waited too long.",
        ),
        Alert(
            "CorralCollectorPauses",
            # Engines and gateways alike; a pass stops every thread of its process.
            f"({pauses(wire.GC_PAUSE_SECONDS)} or {pauses(gw.GC_PAUSE_SECONDS)}) > {t['gcPauseRatio']}",
            "15m",
            "warning",
            "A serving process spends much of its time in garbage-collector passes",
            "{{ $labels.instance }} ({{ $labels.job }}) has spent {{ $value | humanizePercentage }} of its "
            "time in Python's collector passes for 15 minutes; its steps and streams wait during each.",
        ),
        Alert(
            "CorralAdapterSlotsFull",
            # Share of adapter requests the gateway's LoRA affinity could only send to a full replica.
            f"({adapter_routes(FULL_SLOTS)} / {adapter_routes()}) > {t['adapterFullRatio']}",
            "15m",
            "warning",
            "LoRA adapter requests wait for adapter slots",
            "{{ $value | humanizePercentage }} of {{ $labels.model }} adapter requests went to replicas "
            "whose adapter slots were all taken, for 15 minutes; they wait for a slot to free.",
        ),
        Alert(
            "CorralOperatorReconcileErrors",
            f'sum by (reason) (increase({op.RECONCILE_ERRORS_TOTAL}{{reason!="invalid_spec"}}[10m])) > 0',
            "10m",
            "warning",
            "The operator keeps failing to reconcile",
            "Reconcile ticks fail with reason {{ $labels.reason }} ({{ $value | humanize }} in 10 minutes).",
        ),
    ]


_PROMETHEUS_TEMPLATE = re.compile(r"\{\{(.*?)\}\}")


def _escape_for_helm(text: str) -> str:
    """Prometheus's own `{{ ... }}` in annotations, as a raw Go string Helm leaves alone."""
    return _PROMETHEUS_TEMPLATE.sub(lambda m: "{{`{{" + m.group(1) + "}}`}}", text)


def _groups(t: Mapping[str, str], runbook_base_url: str, *, is_helm: bool = False) -> dict[str, Any]:
    escape = _escape_for_helm if is_helm else (lambda text: text)
    rules = [a.rule(runbook_base_url, escape) for a in alerts(t)]
    return {"groups": [{"name": GROUP, "rules": rules}]}


def default_thresholds() -> dict[str, str]:
    """values.yaml's thresholds as Helm writes them into the rule (2.0 as `2`, 0.9 as `0.9`)."""
    values = Alerts().model_dump(by_alias=True)
    numbers = {n: v for n, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return {name: f"{value:g}" for name, value in numbers.items()}


def rules_file() -> str:
    """The plain Prometheus rules file, with the default thresholds."""
    header = "# GENERATED by `python -m corral_cli.chartgen` from cli/corral_cli/chartgen/alerts.py.\n"
    groups = _groups(default_thresholds(), RUNBOOK_BASE_URL)
    return header + yaml.safe_dump(groups, sort_keys=False, width=200)


def prometheus_rule_template() -> str:
    """The chart's PrometheusRule: the same rules, thresholds from `.Values.alerts`."""
    helm = {name: f"{{{{ .Values.alerts.{name} }}}}" for name in default_thresholds()}
    groups = _groups(helm, "{{ .Values.alerts.runbookBaseUrl }}", is_helm=True)
    body = yaml.safe_dump(groups, sort_keys=False, width=200)
    spec = "".join(f"  {line}\n" for line in body.splitlines())
    return (
        "{{- /* GENERATED by `python -m corral_cli.chartgen` from cli/corral_cli/chartgen/alerts.py. */}}\n"
        '{{- if and .Values.alerts.enabled (include "corral.monitorKind" (list . "PrometheusRule")) }}\n'
        "apiVersion: monitoring.coreos.com/v1\n"
        "kind: PrometheusRule\n"
        "metadata:\n"
        '  name: {{ include "corral.fullname" . }}-alerts\n'
        "  namespace: {{ .Release.Namespace }}\n"
        "  labels:\n"
        '    {{- include "corral.labels" (dict "ctx" . "component" "alerts") | nindent 4 }}\n'
        "    {{- with .Values.alerts.labels }}\n"
        "    {{- toYaml . | nindent 4 }}\n"
        "    {{- end }}\n"
        "spec:\n" + spec + "{{- end }}\n"
    )
