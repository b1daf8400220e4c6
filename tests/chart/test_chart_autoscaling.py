"""The gateway under its HPA: the chart sets no replica count of its own, but an upgrade keeps the live
Deployment's (a lookup), so switching the HPA on doesn't drop the gateway to one pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.chart.conftest import Helm, find
from tests.chart.fake_api import FakeApi

NAMESPACE = "corral-system"
# Only the gateway's objects, whose kinds the fake API knows.
GATEWAY_ONLY = [
    "--set",
    "operator.enabled=false,networkPolicy.enabled=false,dashboards.enabled=false,tests.enabled=false",
]


def _live_gateway(replicas: int) -> dict[str, Any]:
    """The gateway Deployment as an earlier release left it (with Helm's ownership marks)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "corral-gateway",
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {
                "meta.helm.sh/release-name": "corral",
                "meta.helm.sh/release-namespace": NAMESPACE,
            },
        },
        "spec": {"replicas": replicas},
    }


def _render_against(helm: Helm, api: FakeApi, home: Path, *values: str) -> list[dict[str, Any]]:
    """What `helm upgrade` would apply: rendered with the cluster's answers to the chart's lookups."""
    args = ["--dry-run=server", "--disable-openapi-validation", "--skip-crds"]
    return helm.template(None, *args, "--kubeconfig", str(api.kubeconfig(home)), *GATEWAY_ONLY, *values)


def _replicas(objects: list[dict[str, Any]]) -> int | None:
    (deployment,) = find(objects, "Deployment", "gateway")
    replicas: int | None = deployment["spec"].get("replicas")
    return replicas


def test_switching_the_hpa_on_keeps_the_live_replica_count(helm: Helm, tmp_path: Path) -> None:
    with FakeApi([_live_gateway(replicas=4)]) as api:
        objects = _render_against(helm, api, tmp_path, "--set", "gateway.autoscaling.enabled=true")
    assert _replicas(objects) == 4  # left out, server-side apply would have reset it to 1
    assert find(objects, "HorizontalPodAutoscaler", "gateway")


def test_a_first_install_under_the_hpa_leaves_replicas_to_it(helm: Helm, tmp_path: Path) -> None:
    with FakeApi([]) as api:
        objects = _render_against(helm, api, tmp_path, "--set", "gateway.autoscaling.enabled=true")
    assert _replicas(objects) is None
    # Without a cluster (helm template, Argo CD) there is nothing to keep either.
    assert _replicas(helm.template(None, "--set", "gateway.autoscaling.enabled=true")) is None


def test_without_the_hpa_the_values_set_the_count(helm: Helm, tmp_path: Path) -> None:
    with FakeApi([_live_gateway(replicas=4)]) as api:
        objects = _render_against(helm, api, tmp_path, "--set", "gateway.replicas=3")
    assert _replicas(objects) == 3
