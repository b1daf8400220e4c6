"""Autoscaling modes hpa and keda on the real control plane: the API server accepts the rendered
HorizontalPodAutoscaler and (with KEDA's real CRD installed) ScaledObject, and the operator never
writes spec.replicas in those modes, even under a load its builtin mode would scale on."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import yaml

from e2e.k8s.cluster import Cluster
from e2e.k8s.keda import KedaUnavailable, scaled_object_crd
from e2e.operator.harness import (
    OperatorProcess,
    fake_metrics,
    free_port,
    get_llmd,
    is_available,
    llmdeployment,
    running_pods,
)

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]
QUIET_S = 6.0  # several 1-second operator ticks under a deep queue


def _replicas_hold_under_load(cluster: Cluster, ns: str, name: str, port: int) -> None:
    (pod,) = running_pods(cluster, ns, name)
    with fake_metrics(port, waiting=40, running=8, kv_usage=0.95) as fake:
        fake.serve_on(pod["status"]["podIP"])
        cluster.wait_until(
            "load scraped",
            lambda: ((get_llmd(cluster, ns, name) or {}).get("status") or {}).get("load"),
        )
        time.sleep(QUIET_S)
    cr = get_llmd(cluster, ns, name) or {}
    assert cr["spec"]["replicas"] == 1, "the operator wrote spec.replicas in an external autoscaling mode"


def test_hpa_mode_renders_an_accepted_hpa_and_leaves_replicas_alone(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator(resync_s=1.0)
    port = free_port()
    autoscaling = {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4, "scaleUpStabilizationSeconds": 0}
    cluster.apply(yaml.safe_dump(llmdeployment("by-hpa", ns, replicas=1, port=port, autoscaling=autoscaling)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "by-hpa")))
    hpa = cluster.wait_until("HPA", lambda: cluster.get_json("horizontalpodautoscalers", "-n", ns)["items"])[
        0
    ]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "corral.dev/v1alpha1",
        "kind": "LLMDeployment",
        "name": "by-hpa",
    }
    assert hpa["metadata"]["ownerReferences"][0]["name"] == "by-hpa"
    _replicas_hold_under_load(cluster, ns, "by-hpa", port)
    # what an HPA (or kubectl scale) writes through the scale subresource is kept
    cluster.kubectl("scale", "llmd/by-hpa", "-n", ns, "--replicas=2")
    cluster.wait_until("2 pods Running", lambda: len(running_pods(cluster, ns, "by-hpa")) == 2)


def test_keda_mode_renders_a_scaled_object_keda_accepts(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    try:
        crd = scaled_object_crd()
    except KedaUnavailable as e:
        pytest.skip(str(e))
    cluster.kubectl("apply", "--server-side", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh")
    start_operator(resync_s=1.0)
    port = free_port()
    autoscaling = {
        "mode": "keda",
        "minReplicas": 0,
        "maxReplicas": 3,
        "prometheusUrl": "http://127.0.0.1:9090",
    }
    cluster.apply(
        yaml.safe_dump(llmdeployment("by-keda", ns, replicas=1, port=port, autoscaling=autoscaling))
    )
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "by-keda")))
    scaled = cluster.wait_until("ScaledObject", lambda: cluster.get_json("scaledobjects", "-n", ns)["items"])[
        0
    ]
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "LLMDeployment"
    assert [t["name"] for t in scaled["spec"]["triggers"]] == ["waiting", "kv-usage", "gateway-queue"]
    _replicas_hold_under_load(cluster, ns, "by-keda", port)
