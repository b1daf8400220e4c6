"""On the real control plane: an LLMDeployment with `resources.gpu: 2` becomes a Deployment whose
engine spans its two GPUs (`--tensor-parallel-size 2`) and mounts a memory-backed /dev/shm, for
the bundled engine and for vLLM alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import OperatorProcess, get_llmd, llmdeployment

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]


def _deployment(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", "deployment", name, "-n", ns, "-o", "json", check=False)
    return None if result.returncode != 0 else dict(yaml.safe_load(result.stdout))


@pytest.mark.parametrize("kind", ["corral", "vllm"])
def test_two_gpus_render_tensor_parallel_size_two_and_shared_memory(
    kind: str,
    operator_installed: Cluster,
    start_operator: Callable[..., OperatorProcess],
    k8s_namespace: str,
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    name = f"tp-{kind}"
    manifest = llmdeployment(name, ns, replicas=1)
    manifest["spec"]["engine"]["kind"] = kind
    manifest["spec"]["resources"] = {"cpu": "100m", "memory": "1Gi", "gpu": 2}
    cluster.apply(yaml.safe_dump(manifest))
    dep = cluster.wait_until("the Deployment", lambda: _deployment(cluster, ns, name))
    pod = dep["spec"]["template"]["spec"]
    (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
    argv = [*engine.get("command", []), *engine.get("args", [])]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2", argv
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    # status says how the replica is split; `kubectl get llmd -o wide` shows it as TP
    cluster.wait_until(
        "status.tensorParallelSize",
        lambda: ((get_llmd(cluster, ns, name) or {}).get("status") or {}).get("tensorParallelSize") == 2,
    )
    header = cluster.kubectl("get", "llmd", name, "-n", ns, "-o", "wide").stdout.splitlines()[0]
    assert "TP" in header.split()
