"""Pure builders for what the test control plane writes: kubeconfigs, the token file, fake Nodes.

Every address here is loopback: nodes report 127.0.0.1, kwok hands out pod IPs from POD_CIDR and
ClusterIPs come from SERVICE_CIDR, so even a component that dialed one by mistake would stay on the host.
"""

from __future__ import annotations

import csv
import io
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LOOPBACK_NETWORK = ipaddress.ip_network("127.0.0.0/8")
NODE_IP = "127.0.0.1"
POD_CIDR = "127.1.0.0/16"
SERVICE_CIDR = "127.96.0.0/16"

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True, slots=True)
class FakeNode:
    """A kwok-managed Node; num_gpus > 0 makes it advertise nvidia.com/gpu."""

    name: str
    num_gpus: int = 0
    num_cpus: int = 32
    memory: str = "256Gi"
    max_pods: int = 110


DEFAULT_NODES = (FakeNode("kwok-cpu-0"), FakeNode("kwok-gpu-0", num_gpus=4))


@dataclass(frozen=True, slots=True)
class StaticToken:
    token: str
    user: str
    uid: str
    groups: tuple[str, ...] = ()


def token_file_text(tokens: Iterable[StaticToken]) -> str:
    """The kube-apiserver --token-auth-file format: token,user,uid,"group1,group2"."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for t in tokens:
        writer.writerow([t.token, t.user, t.uid, ",".join(t.groups)])
    return out.getvalue()


def kubeconfig(
    server_url: str,
    ca_file: str,
    user: str,
    *,
    token: str | None = None,
    client_cert_file: str | None = None,
    client_key_file: str | None = None,
) -> dict[str, Any]:
    """A one-context kubeconfig authenticating with a bearer token or a client certificate."""
    credentials: dict[str, str] = {}
    if token is not None:
        credentials["token"] = token
    if client_cert_file is not None and client_key_file is not None:
        credentials["client-certificate"] = client_cert_file
        credentials["client-key"] = client_key_file
    if not credentials:
        raise ValueError("a kubeconfig needs a token or a client certificate and key")
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "corral-e2e", "cluster": {"server": server_url, "certificate-authority": ca_file}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "corral-e2e", "context": {"cluster": "corral-e2e", "user": user}}],
        "current-context": "corral-e2e",
    }


def node_manifest(node: FakeNode) -> dict[str, Any]:
    """A Node that kwok manages; status is accepted on create, so capacity is declared up front."""
    resources: dict[str, str] = {
        "cpu": str(node.num_cpus),
        "memory": node.memory,
        "pods": str(node.max_pods),
    }
    labels = {
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    if node.num_gpus > 0:
        resources[GPU_RESOURCE] = str(node.num_gpus)
        labels["nvidia.com/gpu.present"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "labels": labels, "annotations": {KWOK_NODE_ANNOTATION: "fake"}},
        "status": {
            "allocatable": resources,
            "capacity": resources,
            "addresses": [
                {"type": "InternalIP", "address": NODE_IP},
                {"type": "Hostname", "address": node.name},
            ],
        },
    }


def non_loopback_addresses(endpoint_slices: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every address in the given EndpointSlice objects that is not loopback (FQDNs included)."""
    bad: list[str] = []
    for endpoint_slice in endpoint_slices:
        for endpoint in endpoint_slice.get("endpoints") or ():
            for address in endpoint.get("addresses") or ():
                if not _is_loopback(address):
                    bad.append(address)
    return bad


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback  # 127.0.0.0/8 or ::1
    except ValueError:
        return False
