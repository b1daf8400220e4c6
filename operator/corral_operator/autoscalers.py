"""Pure renderers for the external autoscaling modes, both on the LLMDeployment's scale subresource:
an autoscaling/v2 HorizontalPodAutoscaler (`hpa`) or a KEDA ScaledObject (`keda`).

In these modes the operator renders the object and never writes spec.replicas itself, so a GitOps
tool that owns the manifest sees no drift (it should ignore spec.replicas, as for any HPA target).
"""

from __future__ import annotations

import re
from typing import Any

from corral_engine import wire

from corral_operator import labels
from corral_operator.spec import API_VERSION, KIND, AutoscalingSpec, LLMDeploymentSpec

Obj = dict[str, Any]
SCALED_OBJECT_CRD = "scaledobjects.keda.sh"
# Names the Prometheus adapter serves the engine gauges under (its rule renames `vllm:x` to
# `vllm_x`; examples/README.md has the rule), as per-pod custom metrics of the engine pods.
HPA_WAITING_METRIC = "vllm_num_requests_waiting"
HPA_KV_METRIC = "vllm_kv_cache_usage_perc"
KEDA_POLLING_S = 15
# The pod label naming the LLMDeployment, as a series label: the operator's ServiceMonitor and the
# chart's PodMonitor copy it (podTargetLabels), and Prometheus turns its `.` and `/` into `_` (as a
# `labelmap` of `__meta_kubernetes_pod_label_(.+)` does too).
INSTANCE_SERIES_LABEL = re.sub("[^a-zA-Z0-9_]", "_", labels.INSTANCE)  # app_kubernetes_io_instance


def _target(name: str) -> Obj:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name}


def _behavior(auto: AutoscalingSpec) -> Obj:
    return {
        "scaleUp": {"stabilizationWindowSeconds": auto.scale_up_stabilization_seconds},
        "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_stabilization_seconds},
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a target: whole numbers plain, fractions in milli-units."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def horizontal_pod_autoscaler(meta: Obj, spec: LLMDeploymentSpec) -> Obj:
    auto = _auto(spec)

    def per_pod(metric: str, target: float) -> Obj:
        value = {"type": "AverageValue", "averageValue": _quantity(target)}
        return {"type": "Pods", "pods": {"metric": {"name": metric}, "target": value}}

    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": _target(meta["name"]),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                per_pod(HPA_WAITING_METRIC, auto.target_waiting_per_replica),
                per_pod(HPA_KV_METRIC, auto.target_kv_usage),
            ],
            "behavior": _behavior(auto),
        },
    }


def promql_selector(matchers: dict[str, str]) -> str:
    """`{k="v",...}` with PromQL string escaping (model names may hold quotes or backslashes)."""

    def quoted(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return "{" + ",".join(f"{k}={quoted(v)}" for k, v in matchers.items()) + "}"


def scaled_object(meta: Obj, spec: LLMDeploymentSpec) -> Obj:
    """Triggers: waiting requests per replica, average KV usage, and the gateway's queue for the
    model, which also activates it from zero (KEDA's activation: any held request)."""
    auto = _auto(spec)
    name = spec.model.name
    # This deployment's pods only (another LLMDeployment may serve the same model name in the
    # namespace), and one series per scraped address where two monitors scrape a pod.
    selector = promql_selector({"namespace": meta["namespace"], INSTANCE_SERIES_LABEL: meta["name"]})

    def per_pod(metric: str) -> str:
        return f"max by (instance) ({metric}{selector})"

    # The gateway (perhaps in another namespace) labels its queue with the pool's key: the model
    # name, or NAMESPACE/NAME where the name is served in several namespaces (gateway k8s_names).
    queues = " or ".join(
        f"{wire.GATEWAY_QUEUE_LENGTH}{promql_selector({'model': key})}"
        for key in (name, f"{meta['namespace']}/{name}")
    )

    def trigger(name: str, query: str, threshold: float, metric_type: str, activation: str) -> Obj:
        metadata = {
            "serverAddress": auto.prometheus_url,
            "query": query,
            "threshold": str(threshold),
            "activationThreshold": activation,
        }
        return {"type": "prometheus", "name": name, "metricType": metric_type, "metadata": metadata}

    waiting = auto.target_waiting_per_replica
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": _target(meta["name"]),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "pollingInterval": KEDA_POLLING_S,
            "cooldownPeriod": auto.scale_to_zero_idle_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(auto)}},
            "triggers": [
                trigger(
                    "waiting",
                    f"sum({per_pod(wire.NUM_REQUESTS_WAITING)}) or vector(0)",
                    waiting,
                    "AverageValue",
                    "0",
                ),
                # Value: the HPA scales by average/target, the same rule as the builtin mode's.
                trigger(
                    "kv-usage",
                    f"avg({per_pod(wire.KV_CACHE_USAGE_PERC)}) or vector(0)",
                    auto.target_kv_usage,
                    "Value",
                    "0",
                ),
                trigger(
                    "gateway-queue",
                    f"sum({queues}) or vector(0)",
                    waiting,
                    "AverageValue",
                    "0",
                ),
            ],
        },
    }


def _auto(spec: LLMDeploymentSpec) -> AutoscalingSpec:
    if spec.autoscaling is None:
        raise ValueError("an external autoscaler needs spec.autoscaling")
    return spec.autoscaling
