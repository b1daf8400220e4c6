"""The fleet's wire contract on the Kubernetes side: the operator writes what the gateway reads, and
both decide by the same rule which pods serve (corral_engine.wire)."""

from __future__ import annotations

from typing import Any

import pytest
from corral_engine import wire
from corral_gateway.k8s_discovery import discover, replicas_from_pods
from corral_gateway.k8s_names import Route, served_from_deployments
from corral_gateway.settings import KubernetesDiscovery
from corral_operator import render
from corral_operator.scaling import ready_targets
from corral_operator.spec import parse_spec

from tests.operator.invalid_cases import valid_spec


def pod(
    name: str, *, ready: str = "True", ip: str | None = "10.0.0.1", deleting: bool = False
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "ml", "labels": {wire.MODEL_LABEL: "m"}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": ready}]}
    if ip is not None:
        status["podIP"] = ip
    ports = [{"name": "http", "containerPort": 8000}]
    return {"metadata": metadata, "spec": {"containers": [{"ports": ports}]}, "status": status}


PODS = [
    (pod("ready", ip="10.0.0.1"), True),
    (pod("not-ready", ready="False", ip="10.0.0.2"), False),
    (pod("no-ip", ip=None), False),
    (pod("deleting", deleting=True, ip="10.0.0.4"), False),
    ({"metadata": {"name": "bare"}}, False),
]


@pytest.mark.parametrize(("obj", "is_serving"), PODS, ids=[p["metadata"]["name"] for p, _ in PODS])
def test_the_ready_rule(obj: dict[str, Any], is_serving: bool) -> None:
    assert wire.is_pod_serving(obj) is is_serving


def test_gateway_and_operator_pick_the_same_pods() -> None:
    pods = [p for p, _ in PODS]
    routed = replicas_from_pods(pods, wire.MODEL_LABEL, "http")["m"]
    scraped = ready_targets(pods, 8000)
    assert routed == [f"http://{t.ip}:{t.port}" for t in scraped] == ["http://10.0.0.1:8000"]


def test_the_gateway_finds_what_the_operator_renders() -> None:
    owner = render.Owner(name="tiny", namespace="ml", uid="u")
    service = render.service(owner, parse_spec(valid_spec()))
    labels = service["metadata"]["labels"]
    discovery = KubernetesDiscovery()
    key, _, value = discovery.label_selector.partition("=")
    assert labels[key] == value
    assert labels[discovery.model_label] == "tiny-llama"
    found = discover([service], is_pods=False, model_label=discovery.model_label, port_name="http")
    assert found.owners == {"tiny-llama": ("ml", "tiny")}


def test_openai_style_names_and_aliases_reach_the_gateway_through_the_llmdeployment() -> None:
    raw = valid_spec()
    raw["model"] |= {"name": "meta-llama/Llama-3.1-8B-Instruct", "aliases": ["llama-8b"]}
    raw["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}  # so a request may wake it (owners)
    owner = render.Owner(name="llama", namespace="ml", uid="u")
    service = render.service(owner, parse_spec(raw))
    label = service["metadata"]["labels"][wire.MODEL_LABEL]
    assert label != raw["model"]["name"] and label.startswith("meta-llama.Llama-3.1-8B-Instruct-")
    deployment = {"metadata": {"name": "llama", "namespace": "ml"}, "spec": raw}
    found = discover(
        [service],
        is_pods=False,
        model_label=wire.MODEL_LABEL,
        port_name="http",
        served=served_from_deployments([deployment]),
    )
    assert set(found.pools) == {"meta-llama/Llama-3.1-8B-Instruct"}
    assert found.owners == {"meta-llama/Llama-3.1-8B-Instruct": ("ml", "llama")}
    # What the operator calls waking from zero (AutoscalingSpec.can_wake) is what the gateway reads.
    for mode, can_wake in (("builtin", True), ("keda", True), ("hpa", False)):
        extra = {"prometheusUrl": "http://127.0.0.1:9090"} if mode == "keda" else {}
        bounds = {"minReplicas": 1, "maxReplicas": 2} if mode == "hpa" else raw["autoscaling"]
        spec = parse_spec(raw | {"autoscaling": {**bounds, "mode": mode, **extra}})
        assert spec.autoscaling is not None and spec.autoscaling.can_wake is can_wake
        (served,) = served_from_deployments([{**deployment, "spec": raw | {"autoscaling": {"mode": mode}}}])
        assert served.can_wake is can_wake
    upstream = Route("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct")
    assert found.names.routes["llama-8b"] == upstream
    assert found.names.routes["ml/llama-8b"] == upstream


def test_fetch_exit_codes_mean_the_same_to_the_fetcher_and_the_operator() -> None:
    from corral_engine.sources.errors import KINDS

    assert {code: reason for code, reason in KINDS.values()} == wire.FETCH_EXIT_REASONS
