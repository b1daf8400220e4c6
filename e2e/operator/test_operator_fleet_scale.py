"""100 LLMDeployments reconcile to Available on the real control plane; the time is logged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import yaml

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import OperatorProcess, is_available, llmdeployment

pytestmark = [pytest.mark.k8s, pytest.mark.e2e, pytest.mark.slow]
log = logging.getLogger(__name__)
NUM_DEPLOYMENTS = 100


def test_hundred_llmdeployments_reach_available(
    operator_installed: Cluster,
    start_operator: Callable[..., OperatorProcess],
    k8s_namespace: str,
    record_property: Callable[[str, object], None],
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator(resync_s=10.0)
    docs = [llmdeployment(f"fleet-{i:03d}", ns, replicas=1) for i in range(NUM_DEPLOYMENTS)]
    started = time.monotonic()
    cluster.apply(yaml.safe_dump_all(docs))

    def num_available() -> int:
        return sum(is_available(o) for o in cluster.get_json("llmd", "-n", ns)["items"])

    cluster.wait_until(
        f"{NUM_DEPLOYMENTS} Available", lambda: num_available() == NUM_DEPLOYMENTS, timeout_s=600
    )
    elapsed_s = time.monotonic() - started
    record_property("seconds_to_available", round(elapsed_s, 1))
    log.warning("%d LLMDeployments Available %.1f s after kubectl apply", NUM_DEPLOYMENTS, elapsed_s)
    assert len(cluster.get_json("deployments", "-n", ns)["items"]) == NUM_DEPLOYMENTS
    assert (
        len(cluster.get_json("pods", "-n", ns, "--field-selector", "status.phase=Running")["items"])
        == NUM_DEPLOYMENTS
    )
