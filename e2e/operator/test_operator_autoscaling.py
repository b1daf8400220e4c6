"""Autoscaling against the real control plane, with engine load served on the pods' loopback IPs."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
import yaml
from corral_operator import labels

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import (
    OperatorProcess,
    condition,
    fake_metrics,
    free_port,
    get_llmd,
    is_available,
    llmdeployment,
    running_pods,
)

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]


def _replicas(cluster: Cluster, ns: str, name: str) -> int | None:
    cr = get_llmd(cluster, ns, name)
    return None if cr is None else cr["spec"].get("replicas")


def test_deep_queue_scales_up(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator(resync_s=1.0)
    port = free_port()
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetWaitingPerReplica": 4,
        "scaleUpStabilizationSeconds": 0,
    }
    cluster.apply(yaml.safe_dump(llmdeployment("busy", ns, replicas=1, port=port, autoscaling=autoscaling)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "busy")))
    assert _replicas(cluster, ns, "busy") == 1  # no load reported yet: holds
    (pod,) = running_pods(cluster, ns, "busy")
    with fake_metrics(port, waiting=40, running=8, kv_usage=0.95) as fake:
        fake.serve_on(pod["status"]["podIP"])
        cluster.wait_until("scaled to max", lambda: _replicas(cluster, ns, "busy") == 4)
        cluster.wait_until("4 pods Running", lambda: len(running_pods(cluster, ns, "busy")) == 4)
    assert cluster.get_json("deployment", "busy", "-n", ns)["spec"]["replicas"] == 4

    def has_scaled_event() -> bool:
        events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=busy")["items"]
        return any(e["reason"] == "Scaled" and "1 -> 4" in e["message"] for e in events)

    cluster.wait_until("Scaled event", has_scaled_event)


def test_idle_model_scales_to_zero_and_wakes_on_annotation(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    operator = start_operator(resync_s=1.0)
    port = free_port()
    autoscaling = {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroIdleSeconds": 3}
    cluster.apply(yaml.safe_dump(llmdeployment("sleepy", ns, replicas=1, port=port, autoscaling=autoscaling)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "sleepy")))
    (pod,) = running_pods(cluster, ns, "sleepy")
    with fake_metrics(port, waiting=0, running=0, kv_usage=0.0) as fake:
        fake.serve_on(pod["status"]["podIP"])
        cluster.wait_until("scaled to zero", lambda: _replicas(cluster, ns, "sleepy") == 0, timeout_s=60)
    cluster.wait_until(
        "ScaledToZero",
        lambda: condition(get_llmd(cluster, ns, "sleepy"), "Available").get("reason") == "ScaledToZero",
    )
    cluster.wait_until("pods gone", lambda: not running_pods(cluster, ns, "sleepy"))
    # the gateway's wake-up: an annotation with the request time
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.kubectl("annotate", "llmd", "sleepy", "-n", ns, f"{labels.WAKE_ANNOTATION}={now}", "--overwrite")
    cluster.wait_until("woken", lambda: _replicas(cluster, ns, "sleepy") == 1)
    cluster.wait_until("Available again", lambda: is_available(get_llmd(cluster, ns, "sleepy")))
    # put to sleep by hand: the wake annotation still on the object is no new request
    cluster.kubectl("scale", "llmd", "sleepy", "-n", ns, "--replicas", "0")
    cluster.wait_until("pods gone again", lambda: not running_pods(cluster, ns, "sleepy"))
    time.sleep(4 * operator.resync_s)
    assert _replicas(cluster, ns, "sleepy") == 0
    events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=sleepy")["items"]
    assert [e["message"] for e in events if e["reason"] == "Scaled" and "woken" in e["message"]] == [
        "replicas 0 -> 1: woken by a request"
    ]
