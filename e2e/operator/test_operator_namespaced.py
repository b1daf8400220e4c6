"""A namespaced operator (`corral operator --namespace NS`) works with a Role in NS and nothing else,
ServiceMonitors included: it finds their kind through API discovery, without reading CRDs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import yaml
from corral_operator import rbac

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import (
    OperatorProcess,
    get_llmd,
    install_service_monitor_crd,
    is_available,
    llmdeployment,
)

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]
USER = "corral-operator-namespaced-e2e"


def test_namespaced_operator_needs_only_a_role(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    kubeconfig = cluster.kubeconfig_for(USER)
    subject = {"kind": "User", "name": USER, "apiGroup": "rbac.authorization.k8s.io"}
    cluster.apply(yaml.safe_dump_all(rbac.namespaced_documents([ns], subject)))
    cluster.apply(
        yaml.safe_dump(
            {
                "apiVersion": "kopf.dev/v1",
                "kind": "KopfPeering",
                "metadata": {"name": "corral", "namespace": ns},
            }
        )
    )

    def can_i(*args: str) -> str:
        return cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False).stdout.strip()

    cluster.wait_until(
        "the Role applies", lambda: can_i("list", "llmdeployments.corral.dev", "-n", ns) == "yes"
    )
    assert can_i("list", "llmdeployments.corral.dev", "--all-namespaces") == "no"
    assert can_i("list", "deployments", "-n", "default") == "no"
    assert can_i("get", "customresourcedefinitions.apiextensions.k8s.io") == "no"
    install_service_monitor_crd(cluster)
    start_operator(namespaces=[ns], kubeconfig=kubeconfig)
    cluster.apply(yaml.safe_dump(llmdeployment("scoped", ns, replicas=2)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "scoped")))
    for kind in ("deployment", "service", "poddisruptionbudget"):
        cluster.get_json(kind, "scoped", "-n", ns)
    # Found through API discovery (the operator looks again each minute, should it have looked too soon).
    cluster.wait_until(
        "the ServiceMonitor",
        lambda: cluster.kubectl("get", "servicemonitor", "scoped", "-n", ns, check=False).returncode == 0,
        timeout_s=90,
    )
    monitor = cluster.get_json("servicemonitor", "scoped", "-n", ns)
    assert monitor["metadata"]["ownerReferences"][0]["name"] == "scoped"
