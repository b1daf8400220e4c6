"""Kubernetes discovery: the settings' namespaces, and the watcher against an API stand-in."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from corral_engine import wire
from corral_gateway.k8s_discovery import Discovery, KubernetesWatcher
from corral_gateway.settings import KubernetesDiscovery
from pydantic import ValidationError

from tests.gateway.fake_kube_api import FakeKubeApi, serve


def test_a_model_at_zero_replicas_stays_known() -> None:
    from corral_gateway.k8s_discovery import replicas_from_slices

    empty = {"metadata": {"labels": {"corral.dev/model": "tiny"}}, "ports": None, "endpoints": None}
    assert replicas_from_slices([empty], "corral.dev/model", "http") == {"tiny": []}


def test_settings_take_a_list_of_namespaces_and_the_older_single_one() -> None:
    assert KubernetesDiscovery().namespaces == ()  # every namespace
    assert KubernetesDiscovery(namespaces=["team-a", "team-b", "team-a"]).namespaces == ("team-a", "team-b")
    assert KubernetesDiscovery.model_validate({"namespace": "team-a"}).namespaces == ("team-a",)
    assert KubernetesDiscovery.model_validate({"namespace": None}).namespaces == ()
    assert KubernetesDiscovery.model_validate({"namespace": ""}).namespaces == ()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"namespace": "team-a", "namespaces": ["team-b"]}, "set kubernetes.namespaces only"),
        ({"namespaces": ["Team_A"]}, "should match pattern"),
        ({"namespaces": [""]}, "should match pattern"),
    ],
)
def test_settings_refuse_bad_namespaces(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KubernetesDiscovery.model_validate(data)


def test_settings_from_the_environment_take_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from corral_gateway.settings import GatewaySettings

    monkeypatch.setenv("CORRAL_GATEWAY_KUBERNETES__NAMESPACES", '["team-a", "team-b"]')
    assert GatewaySettings().kubernetes.namespaces == ("team-a", "team-b")


def _llmd(namespace: str, name: str, model: str) -> dict[str, Any]:
    meta = {"namespace": namespace, "name": name}
    return {
        "apiVersion": "corral.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": meta,
        "spec": {"model": {"name": model}, "autoscaling": {"minReplicas": 0}},
    }


def _pod(namespace: str, name: str, owner: str, ip: str) -> dict[str, Any]:
    labels = {wire.MANAGED_BY_LABEL: wire.MANAGED_BY_VALUE, wire.INSTANCE_LABEL: owner}
    container = {"name": "engine", "image": "engine", "ports": [{"name": "http", "containerPort": 8100}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "labels": labels},
        "spec": {"containers": [container]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


async def _next_discovery(found: asyncio.Queue[Discovery], wanted: Callable[[Discovery], bool]) -> Discovery:
    # A guard against a hang, not a measurement: the first discovery includes importing the
    # kubernetes client in the watcher's threads, 13 s on a loaded 2-core machine.
    async with asyncio.timeout(60):
        while not wanted(latest := await found.get()):
            pass
    return latest


async def test_the_watcher_watches_each_namespace_and_pools_them_together(tmp_path: Path) -> None:
    """Two namespaces, each with its own watches (cluster-wide reads are refused, as with Roles only):
    replicas of both reach the gateway, a name served in both is asked for as NAMESPACE/NAME, and an
    event in one namespace leaves the other's replicas alone."""
    api = FakeKubeApi()
    api.items[("team-a", "llmdeployments")] = [_llmd("team-a", "llama", "llama")]
    api.items[("team-a", "pods")] = [_pod("team-a", "llama-0", "llama", "10.0.0.1")]
    api.items[("team-b", "llmdeployments")] = [
        _llmd("team-b", "llama", "llama"),
        _llmd("team-b", "qwen", "qwen"),
    ]
    api.items[("team-b", "pods")] = [
        _pod("team-b", "llama-0", "llama", "10.0.1.1"),
        _pod("team-b", "qwen-0", "qwen", "10.0.1.2"),
    ]
    found: asyncio.Queue[Discovery] = asyncio.Queue()
    with serve(api, tmp_path) as kubeconfig:
        config = KubernetesDiscovery(
            enabled=True, source="pods", namespaces=("team-a", "team-b"), kubeconfig=kubeconfig
        )
        watcher = KubernetesWatcher(config, found.put_nowait)
        watcher.start(asyncio.get_running_loop())
        try:
            first = await _next_discovery(found, lambda d: True)
            assert first.pools == {
                "team-a/llama": ["http://10.0.0.1:8100"],
                "team-b/llama": ["http://10.0.1.1:8100"],
                "qwen": ["http://10.0.1.2:8100"],
            }
            assert first.owners["qwen"] == ("team-b", "qwen")
            # A watch event in team-b, then team-a's watch ending and its list coming back emptier:
            # each changes its own namespace only.
            api.push("team-b", "pods", "DELETED", _pod("team-b", "qwen-0", "qwen", "10.0.1.2"))
            after = await _next_discovery(found, lambda d: d.pools.get("qwen") == [])
            assert after.pools["team-a/llama"] == ["http://10.0.0.1:8100"]
            api.items[("team-a", "pods")] = []
            api.end("team-a", "pods")
            after = await _next_discovery(found, lambda d: d.pools.get("team-a/llama") == [])
            assert after.pools == {"team-a/llama": [], "team-b/llama": ["http://10.0.1.1:8100"], "qwen": []}
        finally:
            watcher.stop()
    paths = {path for path, _ in api.requests}
    assert paths == {
        f"{prefix}/namespaces/{ns}/{plural}"
        for ns in ("team-a", "team-b")
        for prefix, plural in (("/api/v1", "pods"), ("/apis/corral.dev/v1alpha1", "llmdeployments"))
    }


async def test_the_watcher_outlives_an_api_server_that_refuses_connections(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An API server restarting refuses connections for a while: the watch retries and lists once it
    answers (urllib3's refusal is no OSError; uncaught, it ended the watch's thread for good)."""
    api = FakeKubeApi()
    api.items[("team-a", "llmdeployments")] = [_llmd("team-a", "llama", "llama")]
    api.items[("team-a", "pods")] = [_pod("team-a", "llama-0", "llama", "10.0.0.1")]
    is_up = threading.Event()
    found: asyncio.Queue[Discovery] = asyncio.Queue()
    with serve(api, tmp_path, listen_after=is_up) as kubeconfig:
        config = KubernetesDiscovery(
            enabled=True, source="pods", namespaces=("team-a",), kubeconfig=kubeconfig
        )
        watcher = KubernetesWatcher(config, found.put_nowait)
        with caplog.at_level(logging.WARNING, logger="corral_gateway.k8s_discovery"):
            watcher.start(asyncio.get_running_loop())
            try:
                async with asyncio.timeout(60):  # a guard against a hang
                    while "watch in namespace team-a failed" not in caplog.text:
                        await asyncio.sleep(0.05)
                is_up.set()
                discovery = await _next_discovery(found, lambda d: True)
            finally:
                watcher.stop()
    assert discovery.pools == {"llama": ["http://10.0.0.1:8100"]}


def test_no_namespaces_is_one_watch_of_every_namespace() -> None:
    config = KubernetesDiscovery(enabled=True)
    assert KubernetesWatcher(config, lambda d: None).watches() == [("objects", None), ("deployments", None)]
    config = KubernetesDiscovery(enabled=True, namespaces=("a", "b"), read_llmdeployments=False)
    assert KubernetesWatcher(config, lambda d: None).watches() == [("objects", "a"), ("objects", "b")]
