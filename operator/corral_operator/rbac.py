"""The operator's least-privilege RBAC: one list of rules, rendered to YAML for kubectl and the chart.

`python -m corral_operator.rbac > deploy/rbac/operator.yaml` regenerates the committed file; a unit
test checks it is current. Each rule says why the operator needs it.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from corral_operator.spec import GROUP, PLURAL

RBAC_PATH = "deploy/rbac/operator.yaml"
NAME = "corral-operator"
NAMESPACE = "corral-system"
# Server-side apply is a PATCH that may create; only what pruning removes needs list and delete.
APPLY = ["create", "patch"]
PRUNE = ["list", "delete"]
READ = ["get", "list", "watch"]

# (why, rule) pairs; the chart templates the same rules. None is needed to learn whether the optional
# kinds (ServiceMonitor, ScaledObject) exist: API discovery, which every authenticated user may read,
# tells (kube.Kube.serves), so a namespaced operator finds them too.
RULES: list[tuple[str, dict[str, Any]]] = [
    (
        "watch LLMDeployments; kopf records progress in their annotations",
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    ),
    (
        "write status and replicas (the scale subresource)",
        {
            "apiGroups": [GROUP],
            "resources": [f"{PLURAL}/status", f"{PLURAL}/scale"],
            "verbs": ["get", "patch"],
        },
    ),
    (
        "set blockOwnerDeletion on children's owner references",
        {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    ),
    (
        "the engine Deployment; watched to refresh status as rollouts move",
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": READ + APPLY},
    ),
    ("the engine Service", {"apiGroups": [""], "resources": ["services"], "verbs": APPLY}),
    (
        "the PodDisruptionBudget (at every size, so never pruned)",
        # a copy: the dump would write a list shared with the Service's rule as a YAML alias
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": [*APPLY]},
    ),
    (
        "a ServiceMonitor when Prometheus Operator is installed",
        {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors"], "verbs": APPLY + PRUNE},
    ),
    (
        "a HorizontalPodAutoscaler in autoscaling mode hpa",
        {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": APPLY + PRUNE},
    ),
    (
        "a KEDA ScaledObject in autoscaling mode keda",
        {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": APPLY + PRUNE},
    ),
    (
        "status from pods (image pulls, crash loops) and their IPs for metrics",
        {"apiGroups": [""], "resources": ["pods"], "verbs": READ},
    ),
    (
        "detect a missing model PVC",
        {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
    ),
    (
        "Events on important transitions",
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ),
    (
        "Events (events.k8s.io API)",
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    ),
    (
        "kopf peering between replicas, cluster-wide mode",
        {
            "apiGroups": ["kopf.dev"],
            "resources": ["clusterkopfpeerings"],
            "verbs": ["get", "list", "watch", "patch"],
        },
    ),
    (
        "kopf peering between replicas, namespaced mode",
        {
            "apiGroups": ["kopf.dev"],
            "resources": ["kopfpeerings"],
            "verbs": ["get", "list", "watch", "patch"],
        },
    ),
]


def cluster_role(name: str = NAME) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": NAME}},
        "rules": [rule for _, rule in RULES],
    }


def documents(namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    account = {"kind": "ServiceAccount", "name": NAME, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": namespace}},
        cluster_role(),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": [account],
        },
    ]


def _is_cluster_scoped(rule: dict[str, Any]) -> bool:
    return "clusterkopfpeerings" in rule["resources"]


def namespaced_role(namespace: str, name: str = NAME) -> dict[str, Any]:
    """For `corral operator --namespace NS`: the same rules minus the cluster-scoped one (the cluster's
    peering object), as a Role in NS. It still makes ServiceMonitors and ScaledObjects where their
    CRDs are installed: it learns that from API discovery, not from the CRDs."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": NAME}},
        "rules": [rule for _, rule in RULES if not _is_cluster_scoped(rule)],
    }


def namespaced_documents(served_namespaces: list[str], subject: dict[str, Any]) -> list[dict[str, Any]]:
    """A Role and a RoleBinding to `subject` in each namespace a namespaced operator serves."""
    docs: list[dict[str, Any]] = []
    for ns in served_namespaces:
        docs.append(namespaced_role(ns))
        docs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": NAME, "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
                "subjects": [subject],
            }
        )
    return docs


HEADER = "# GENERATED by `python -m corral_operator.rbac` from corral_operator/rbac.py. Do not edit.\n"


def render_yaml(namespace: str = NAMESPACE) -> str:
    return HEADER + yaml.safe_dump_all(documents(namespace), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render_yaml())
