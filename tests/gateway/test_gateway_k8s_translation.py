"""EndpointSlice -> replica URLs, without a cluster."""

from __future__ import annotations

from typing import Any

from corral_gateway.k8s_discovery import replicas_from_pods, replicas_from_slices

MODEL_LABEL = "corral.dev/model"


def eps(
    name: str, model: str | None, endpoints: list[dict[str, Any]], ports: Any = None, **extra: Any
) -> dict:
    labels = {"kubernetes.io/service-name": f"svc-{name}"}
    if model:
        labels[MODEL_LABEL] = model
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "addressType": extra.get("address_type", "IPv4"),
        "ports": ports if ports is not None else [{"name": "http", "port": 8100, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def ep(address: str, ready: bool | None = True, terminating: bool | None = None) -> dict[str, Any]:
    conditions: dict[str, Any] = {}
    if ready is not None:
        conditions["ready"] = ready
    if terminating is not None:
        conditions["terminating"] = terminating
    return {"addresses": [address], "conditions": conditions}


def test_ready_endpoints_only_grouped_by_model_across_slices() -> None:
    slices = [
        eps("a-1", "llama", [ep("10.0.0.1"), ep("10.0.0.2", ready=False)]),
        eps("a-2", "llama", [ep("10.0.0.3", ready=None), ep("10.0.0.4", terminating=True)]),
        eps("b-1", "qwen", [ep("10.0.1.1")]),
    ]
    assert replicas_from_slices(slices, MODEL_LABEL, "http") == {
        "llama": ["http://10.0.0.1:8100", "http://10.0.0.3:8100"],
        "qwen": ["http://10.0.1.1:8100"],
    }


def test_named_port_preferred_then_first_tcp_port() -> None:
    ports = [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8200}]
    assert replicas_from_slices([eps("a", "m", [ep("10.0.0.1")], ports)], MODEL_LABEL, "http") == {
        "m": ["http://10.0.0.1:8200"]
    }
    ports = [{"name": "web", "port": 8300, "protocol": "TCP"}]
    assert replicas_from_slices([eps("a", "m", [ep("10.0.0.1")], ports)], MODEL_LABEL, "http") == {
        "m": ["http://10.0.0.1:8300"]
    }
    assert replicas_from_slices([eps("a", "m", [ep("10.0.0.1")], [])], MODEL_LABEL, "http") == {
        "m": []
    }  # known, no replicas (e.g. scaled to zero)


def test_model_falls_back_to_service_name_and_ipv6_is_bracketed() -> None:
    slices = [eps("a", None, [ep("fd00::1")], address_type="IPv6")]
    assert replicas_from_slices(slices, MODEL_LABEL, "http") == {"svc-a": ["http://[fd00::1]:8100"]}


def test_model_with_no_ready_endpoints_is_known_but_empty() -> None:
    slices = [eps("a", "m", [ep("10.0.0.1", ready=False)])]
    assert replicas_from_slices(slices, MODEL_LABEL, "http") == {"m": []}


def pod(
    name: str, ip: str | None, ready: bool, model: str | None = "m", deleting: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": {MODEL_LABEL: model} if model else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8100}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_pods_ready_with_an_ip_become_replicas() -> None:
    pods = [
        pod("a", "127.1.0.5", ready=True),
        pod("b", "127.1.0.6", ready=False),
        pod("c", None, ready=True),
        pod("d", "127.1.0.7", ready=True, deleting=True),
        pod("e", "127.1.0.8", ready=True, model=None),
    ]
    assert replicas_from_pods(pods, MODEL_LABEL, "http") == {"m": ["http://127.1.0.5:8100"]}
