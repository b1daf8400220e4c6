"""End to end through the gateway: a real `corral engine` on an operator-managed pod's loopback address,
discovered by a real `corral gateway`, answers the official OpenAI client; and a request for a model at
zero replicas makes the gateway wake it through the operator. Every address dialled is in 127.0.0.0/8."""

from __future__ import annotations

import ipaddress
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import yaml
from corral_operator import labels

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
log = logging.getLogger(__name__)


def _endpoints(cluster: Cluster, ns: str, service: str) -> list[str]:
    slices = cluster.assert_endpoint_slices_loopback(ns, service)
    return [a for s in slices for e in s.get("endpoints") or [] for a in e.get("addresses") or []]


def _loopback_endpoints_rejected(cluster: Cluster, ns: str) -> bool:
    events = cluster.get_json("events", "-n", ns)["items"]
    return any(
        e.get("reason") == "FailedToUpdateEndpointSlices" and "loopback" in e.get("message", "")
        for e in events
    )


@contextmanager
def gateway_process(
    cluster: Cluster, ns: str, source: str, tmp_path: Path, **discovery: object
) -> Iterator[ManagedProcess]:
    config = tmp_path / f"gateway-{source}.yaml"
    settings = {
        "enabled": True,
        "source": source,
        "namespace": ns,
        "kubeconfig": str(cluster.admin_kubeconfig),
    }
    config.write_text(yaml.safe_dump({"kubernetes": {**settings, **discovery}}))
    port = free_port()
    argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--config", str(config)]
    # /ready: the first discovery list is in, so a model at zero is known (to wake), not a 404.
    with ManagedProcess(argv, port, name="gateway", log_dir=tmp_path, health_path="/ready") as gateway:
        gateway.wait_ready(60)
        yield gateway


def test_gateway_serves_a_chat_completion_from_an_operator_managed_replica(
    operator_installed: Cluster,
    start_operator: Callable[..., OperatorProcess],
    k8s_namespace: str,
    tiny_model_dir: Path,
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
    # The standard path is the Service's EndpointSlices; the API server refuses loopback addresses in
    # them, so on this cluster the gateway reads the same labels from the ready Pods instead.
    source = "endpointslices" if _endpoints(cluster, ns, "tiny") == [pod_ip] else "pods"
    log.warning("gateway discovery source: %s", source)

    engine_argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(tiny_model_dir)]
    engine_argv += ["--served-model-name", "tiny", "--host", pod_ip, "--port", str(port)]
    with ManagedProcess(engine_argv, port, name="engine", log_dir=tmp_path) as engine:
        engine.url = f"http://{pod_ip}:{port}"  # the pod's address, not 127.0.0.1
        engine.wait_ready(180)
        with gateway_process(cluster, ns, source, tmp_path) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
            cluster.wait_until(
                "gateway lists the model", lambda: "tiny" in [m.id for m in client.models.list()]
            )
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
            )
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens > 0


def test_a_request_for_a_model_at_zero_is_held_woken_and_answered(
    operator_installed: Cluster,
    start_operator: Callable[..., OperatorProcess],
    k8s_namespace: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """The model has an OpenAI-style name and is asked for by its alias: the gateway learns both
    from the LLMDeployment, holds the request, annotates the deployment; the operator scales it up;
    the woken pod becomes ready; the held request is answered by a real engine (200, not 503)."""
    cluster, ns = operator_installed, k8s_namespace
    start_operator(resync_s=1.0)
    port = free_port()
    doc = llmdeployment("asleep", ns, replicas=0, port=port)
    doc["spec"]["model"] |= {"name": "corral/tiny-chat", "aliases": ["tiny-chat"]}
    doc["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroIdleSeconds": 600}
    cluster.apply(yaml.safe_dump(doc))
    cluster.wait_until(
        "ScaledToZero",
        lambda: any(
            c.get("reason") == "ScaledToZero"
            for c in ((get_llmd(cluster, ns, "asleep") or {}).get("status") or {}).get("conditions") or ()
        ),
    )
    # The woken pod's loopback address is not known in advance; an engine listening on every local
    # address at the pod's port answers whichever 127.x address the pod gets (nothing leaves loopback).
    engine_argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(tiny_model_dir)]
    engine_argv += ["--served-model-name", "corral/tiny-chat", "--host", "0.0.0.0", "--port", str(port)]
    with ManagedProcess(engine_argv, port, name="engine", log_dir=tmp_path) as engine:
        engine.wait_ready(180)
        # At zero there is no pod: the gateway reads the labels from Pods (loopback pod IPs never reach
        # EndpointSlices here) and the names from the LLMDeployment, so the alias is known to wake.
        with gateway_process(cluster, ns, "pods", tmp_path, wake_timeout_s=120.0) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=150)
            cluster.wait_until(
                "gateway knows the names", lambda: _listed(client) >= {"corral/tiny-chat", "tiny-chat"}
            )
            started_s = time.monotonic()
            stream = client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
            chunks = iter(stream)
            first = next(chunks)
            first_token_s = time.monotonic() - started_s
            rest = list(chunks)
    log.warning("wake from zero: request to first token %.1f s", first_token_s)
    assert first.model == "corral/tiny-chat"  # sent upstream under the served name
    assert rest and rest[-1].choices[0].finish_reason is not None
    cr = get_llmd(cluster, ns, "asleep") or {}
    assert labels.WAKE_ANNOTATION in (cr["metadata"].get("annotations") or {})
    assert cr["spec"]["replicas"] >= 1


def _listed(client: openai.OpenAI) -> set[str]:
    return {m.id for m in client.models.list()}
