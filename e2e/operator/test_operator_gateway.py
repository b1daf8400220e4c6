"""End to end through the gateway: a real `corral engine` on an operator-managed pod's loopback address,
found by `corral gateway` through the EndpointSlices of the operator's Service, answers the official
OpenAI client. Every address dialled is in 127.0.0.0/8."""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import yaml

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import (
    LOOPBACK,
    OperatorProcess,
    free_port,
    get_llmd,
    is_available,
    llmdeployment,
    running_pods,
)
from e2e.procs import ManagedProcess

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]


def _endpoints(cluster: Cluster, ns: str, service: str) -> list[str]:
    slices = cluster.assert_endpoint_slices_loopback(ns, service)
    return [a for s in slices for e in s.get("endpoints") or [] for a in e.get("addresses") or []]


def _loopback_endpoints_rejected(cluster: Cluster, ns: str) -> bool:
    events = cluster.get_json("events", "-n", ns)["items"]
    return any(
        e.get("reason") == "FailedToUpdateEndpointSlices" and "loopback" in e.get("message", "")
        for e in events
    )


def test_gateway_serves_a_chat_completion_from_an_operator_managed_replica(
    operator_installed: Cluster,
    start_operator: Callable[..., OperatorProcess],
    k8s_namespace: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    port = free_port()
    cluster.apply(yaml.safe_dump(llmdeployment("tiny", ns, replicas=1, port=port)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "tiny")))
    (pod,) = running_pods(cluster, ns, "tiny")
    pod_ip = pod["status"]["podIP"]
    assert ipaddress.ip_address(pod_ip) in LOOPBACK
    cluster.wait_until(
        "EndpointSlice endpoint (or its rejection)",
        lambda: _endpoints(cluster, ns, "tiny") == [pod_ip] or _loopback_endpoints_rejected(cluster, ns),
    )
    if _endpoints(cluster, ns, "tiny") != [pod_ip]:
        pytest.skip(
            "the e2e cluster's API server rejects loopback EndpointSlice addresses "
            "('may not be in the loopback range'), so the gateway has nothing to discover (issue 5)"
        )

    tiny_model_dir: Path = request.getfixturevalue("tiny_model_dir")  # only once discovery can work
    engine_argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(tiny_model_dir)]
    engine_argv += ["--served-model-name", "tiny", "--host", pod_ip, "--port", str(port)]
    with ManagedProcess(engine_argv, port, name="engine", log_dir=tmp_path) as engine:
        engine.url = f"http://{pod_ip}:{port}"  # the pod's address, not 127.0.0.1
        engine.wait_ready(180)
        config = tmp_path / "gateway.yaml"
        discovery = {"enabled": True, "namespace": ns, "kubeconfig": str(cluster.admin_kubeconfig)}
        config.write_text(yaml.safe_dump({"kubernetes": discovery}))
        gateway_port = free_port()
        gateway_argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", "127.0.0.1"]
        gateway_argv += ["--port", str(gateway_port), "--config", str(config)]
        with ManagedProcess(gateway_argv, gateway_port, name="gateway", log_dir=tmp_path) as gateway:
            gateway.wait_ready(60)
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
            cluster.wait_until(
                "gateway lists the model", lambda: "tiny" in [m.id for m in client.models.list()]
            )
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
            )
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens > 0
