"""Operator e2e fixtures: CRDs, RBAC and the peering object applied once; an operator per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e2e.k8s.cluster import OPERATOR_NAMESPACE, Cluster
from e2e.operator.harness import ROOT, OperatorProcess


@pytest.fixture(scope="session")
def operator_installed(k8s_crds: Cluster) -> Cluster:
    """What the chart would install before the operator: CRDs, the operator's RBAC, the peering object."""
    k8s_cluster = k8s_crds
    k8s_cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    k8s_cluster.apply(ROOT / "deploy" / "rbac" / "operator.yaml")
    k8s_cluster.apply(ROOT / "deploy" / "peering.yaml")
    return k8s_cluster


@pytest.fixture
def start_operator(
    operator_installed: Cluster, operator_kubeconfig: Path, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    """Start `corral operator` processes (operator identity, exactly the RBAC above); all stopped after."""
    started: list[OperatorProcess] = []

    def start(
        priority: int | None = 100,
        resync_s: float = 2.0,
        namespaces: list[str] | None = None,
        kubeconfig: Path | None = None,
    ) -> OperatorProcess:
        log_path = tmp_path / f"operator-{len(started)}.log"
        process = OperatorProcess(
            kubeconfig or operator_kubeconfig,
            log_path,
            priority=priority,
            resync_s=resync_s,
            namespaces=namespaces,
        )
        started.append(process)
        return process.start().wait_alive()

    yield start
    for process in started:
        process.stop()
    for process in started:
        # RBAC denials read 'is forbidden: User "..." cannot VERB resource ...'
        forbidden = [line for line in process.log().splitlines() if "forbidden: User" in line]
        assert not forbidden, "the operator hit RBAC denials:\n" + "\n".join(forbidden[:10])
