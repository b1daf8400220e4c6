"""Pure tests of the control plane's builders and of the loopback guard (no cluster needed)."""

from __future__ import annotations

import csv
import io
import ipaddress
from typing import Any

import pytest

from e2e.k8s import manifests
from e2e.k8s.manifests import FakeNode, StaticToken


def test_loopback_guard_accepts_loopback_and_empty_slices() -> None:
    slices: list[dict[str, Any]] = [
        {"endpoints": [{"addresses": ["127.0.0.1"]}, {"addresses": ["127.1.2.3"]}]},
        {"endpoints": None},
        {},
    ]

    assert manifests.non_loopback_addresses(slices) == []


def test_loopback_guard_reports_every_other_address() -> None:
    slices = [
        {"endpoints": [{"addresses": ["127.0.0.5", "10.0.0.7"]}]},
        {"endpoints": [{"addresses": ["192.168.1.1"]}, {"addresses": ["engine.corral.svc"]}]},
        {"endpoints": [{"addresses": ["::1"]}, {"addresses": ["fd00::1"]}]},
    ]

    assert manifests.non_loopback_addresses(slices) == [
        "10.0.0.7",
        "192.168.1.1",
        "engine.corral.svc",
        "fd00::1",
    ]


def test_every_address_the_cluster_hands_out_is_loopback() -> None:
    for cidr in (manifests.POD_CIDR, manifests.SERVICE_CIDR, f"{manifests.NODE_IP}/32"):
        assert ipaddress.ip_network(cidr).subnet_of(manifests.LOOPBACK_NETWORK)  # type: ignore[arg-type]


def test_token_file_quotes_the_group_list() -> None:
    tokens = [
        StaticToken("t1", "admin", "u1", ("system:masters",)),
        StaticToken("t2", "op", "u2", ("a", "b")),
    ]

    rows = list(csv.reader(io.StringIO(manifests.token_file_text(tokens))))

    assert rows == [["t1", "admin", "u1", "system:masters"], ["t2", "op", "u2", "a,b"]]


def test_kubeconfig_needs_credentials() -> None:
    with pytest.raises(ValueError, match="token or a client certificate"):
        manifests.kubeconfig("https://127.0.0.1:1", "/ca.crt", "nobody")


def test_kubeconfig_with_client_certificate() -> None:
    config = manifests.kubeconfig(
        "https://127.0.0.1:6443", "/ca.crt", "alice", client_cert_file="/a.crt", client_key_file="/a.key"
    )

    assert config["users"] == [
        {"name": "alice", "user": {"client-certificate": "/a.crt", "client-key": "/a.key"}}
    ]
    assert config["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:6443",
        "certificate-authority": "/ca.crt",
    }


def test_gpu_node_advertises_gpus_and_cpu_node_does_not() -> None:
    gpu = manifests.node_manifest(FakeNode("g", num_gpus=4))
    cpu = manifests.node_manifest(FakeNode("c"))

    assert gpu["status"]["allocatable"][manifests.GPU_RESOURCE] == "4"
    assert gpu["status"]["capacity"][manifests.GPU_RESOURCE] == "4"
    assert manifests.GPU_RESOURCE not in cpu["status"]["allocatable"]
    assert gpu["metadata"]["annotations"] == {manifests.KWOK_NODE_ANNOTATION: "fake"}
    assert gpu["status"]["addresses"][0] == {"type": "InternalIP", "address": manifests.NODE_IP}
