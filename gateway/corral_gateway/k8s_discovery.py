"""Kubernetes discovery: watch EndpointSlices (or Pods) selected by label; ready ones become replicas.

`replicas_from_slices` / `replicas_from_pods` are the pure translations (tested without a cluster).
The watcher runs the synchronous `kubernetes` client in a daemon thread and hands each new
model -> URLs map to the event loop, so replicas come and go without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from corral_engine import wire

from corral_gateway.k8s_wake import owners_from_objects
from corral_gateway.settings import KubernetesDiscovery

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_RETRY_DELAY_S = 1.0


def replicas_from_slices(
    slices: Iterable[Mapping[str, Any]], model_label: str, port_name: str | None
) -> dict[str, list[str]]:
    """EndpointSlices (API JSON, camelCase) -> model -> sorted replica base URLs, ready endpoints only."""
    by_model: dict[str, set[str]] = {}
    for eps in slices:
        labels = (eps.get("metadata") or {}).get("labels") or {}
        model = labels.get(model_label) or labels.get(SERVICE_NAME_LABEL)
        if not model:
            continue
        # A model scaled to zero still has its Service's slice (no endpoints, `ports: null`): keep
        # the model known with no replicas, so requests for it wake it instead of getting 404.
        urls = by_model.setdefault(model, set())
        port = _pick_port(eps.get("ports") or [], port_name)
        if port is None:
            continue
        for endpoint in eps.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            # The API says a missing `ready` means ready; terminating endpoints are never ready.
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if addresses:
                urls.add(_url(addresses[0], port, eps.get("addressType")))
    return {model: sorted(urls) for model, urls in by_model.items()}


def replicas_from_pods(
    pods: Iterable[Mapping[str, Any]], model_label: str, port_name: str | None
) -> dict[str, list[str]]:
    """Pods (API JSON) -> model -> sorted replica base URLs, Ready and not terminating only."""
    by_model: dict[str, set[str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        model = (meta.get("labels") or {}).get(model_label)
        if not model:
            continue
        urls = by_model.setdefault(model, set())
        ports = [
            {"name": p.get("name"), "port": p.get("containerPort"), "protocol": p.get("protocol", "TCP")}
            for c in (pod.get("spec") or {}).get("containers") or []
            for p in c.get("ports") or []
        ]
        port = _pick_port(ports, port_name)
        if wire.is_pod_serving(pod) and port is not None:
            urls.add(_url(pod["status"]["podIP"], port, None))
    return {model: sorted(urls) for model, urls in by_model.items()}


def _pick_port(ports: Sequence[Mapping[str, Any]], port_name: str | None) -> int | None:
    usable = [p for p in ports if isinstance(p.get("port"), int) and p.get("protocol", "TCP") == "TCP"]
    named = [p for p in usable if port_name is not None and p.get("name") == port_name]
    pool = named or usable
    return int(pool[0]["port"]) if pool else None


def _url(address: str, port: int, address_type: str | None) -> str:
    host = f"[{address}]" if address_type == "IPv6" or ":" in address else address
    return f"http://{host}:{port}"


class KubernetesWatcher:
    """List + watch in a daemon thread; `on_change(model -> urls)` runs on the event loop."""

    def __init__(
        self,
        config: KubernetesDiscovery,
        on_change: Callable[[dict[str, list[str]]], None],
        on_owners: Callable[[dict[str, tuple[str, str]]], None] | None = None,
    ) -> None:
        self.config = config
        self.on_change = on_change
        self.on_owners = on_owners
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slices: dict[tuple[str, str], dict[str, Any]] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="corral-k8s-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _emit(self) -> None:
        translate = replicas_from_pods if self.config.source == "pods" else replicas_from_slices
        mapping = translate(self._slices.values(), self.config.model_label, self.config.port_name)
        if self._loop is not None and not self._loop.is_closed():
            # Owners first: a model is never known to the router without the LLMDeployment to wake.
            if self.on_owners is not None:
                owners = owners_from_objects(self._slices.values(), self.config.model_label)
                self._loop.call_soon_threadsafe(self.on_owners, owners)
            self._loop.call_soon_threadsafe(self.on_change, mapping)

    def _run(self) -> None:
        from kubernetes import client, config, watch

        try:
            if self.config.kubeconfig is not None:
                config.load_kube_config(config_file=str(self.config.kubeconfig))
            else:
                config.load_incluster_config()
        except (config.ConfigException, OSError) as e:
            logger.error("kubernetes discovery disabled: cannot load cluster config: %s", e)
            return
        api = client.CoreV1Api() if self.config.source == "pods" else client.DiscoveryV1Api()
        serialize = client.ApiClient().sanitize_for_serialization
        while not self._stop.is_set():
            try:
                self._list_and_watch(api, serialize, watch.Watch())
            except client.ApiException as e:
                logger.warning("%s watch ended (HTTP %s); re-listing", self.config.source, e.status)
                self._stop.wait(_RETRY_DELAY_S)
            except (OSError, ValueError) as e:  # urllib3 errors derive from OSError / ValueError
                logger.warning("%s watch failed: %s; retrying", self.config.source, e)
                self._stop.wait(_RETRY_DELAY_S)

    def _list_and_watch(self, api: Any, serialize: Callable[[Any], Any], w: Any) -> None:
        cfg = self.config
        kind = "pod" if cfg.source == "pods" else "endpoint_slice"
        kwargs: dict[str, Any] = {"label_selector": cfg.label_selector}
        if cfg.namespace:
            list_fn: Callable[..., Any] = getattr(api, f"list_namespaced_{kind}")
            kwargs["namespace"] = cfg.namespace
        else:
            list_fn = getattr(api, f"list_{kind}_for_all_namespaces")
        listed = list_fn(**kwargs)
        self._slices = {_key(s): s for s in (serialize(item) for item in listed.items)}
        self._emit()
        stream = w.stream(
            list_fn,
            resource_version=listed.metadata.resource_version,
            timeout_seconds=cfg.watch_timeout_s,
            **kwargs,
        )
        for event in stream:
            if self._stop.is_set():
                w.stop()
                return
            if event.get("type") == "ERROR":
                return  # e.g. 410 Gone: re-list
            obj = serialize(event["object"])
            if event["type"] == "DELETED":
                self._slices.pop(_key(obj), None)
            else:
                self._slices[_key(obj)] = obj
            self._emit()


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace")), str(meta.get("name"))
