"""Kubernetes discovery: watch EndpointSlices selected by label; ready endpoints become replicas.

`replicas_from_slices` is the pure translation (tested without a cluster). The watcher runs the
synchronous `kubernetes` client in a daemon thread and hands each new model -> URLs map to the
event loop, so replicas come and go without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

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
        port = _pick_port(eps.get("ports") or [], port_name)
        if not model or port is None:
            continue
        urls = by_model.setdefault(model, set())
        for endpoint in eps.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            # The API says a missing `ready` means ready; terminating endpoints are never ready.
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if addresses:
                urls.add(_url(addresses[0], port, eps.get("addressType")))
    return {model: sorted(urls) for model, urls in by_model.items()}


def _pick_port(ports: list[Mapping[str, Any]], port_name: str | None) -> int | None:
    usable = [p for p in ports if isinstance(p.get("port"), int) and p.get("protocol", "TCP") == "TCP"]
    named = [p for p in usable if port_name is not None and p.get("name") == port_name]
    pool = named or usable
    return int(pool[0]["port"]) if pool else None


def _url(address: str, port: int, address_type: str | None) -> str:
    host = f"[{address}]" if address_type == "IPv6" or ":" in address else address
    return f"http://{host}:{port}"


class EndpointSliceWatcher:
    """List + watch in a daemon thread; `on_change(model -> urls)` runs on the event loop."""

    def __init__(
        self, config: KubernetesDiscovery, on_change: Callable[[dict[str, list[str]]], None]
    ) -> None:
        self.config = config
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slices: dict[tuple[str, str], dict[str, Any]] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="corral-endpointslice-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _emit(self) -> None:
        mapping = replicas_from_slices(self._slices.values(), self.config.model_label, self.config.port_name)
        if self._loop is not None and not self._loop.is_closed():
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
        api = client.DiscoveryV1Api()
        serialize = client.ApiClient().sanitize_for_serialization
        while not self._stop.is_set():
            try:
                self._list_and_watch(api, serialize, watch.Watch())
            except client.ApiException as e:
                logger.warning("EndpointSlice watch ended (HTTP %s); re-listing", e.status)
                self._stop.wait(_RETRY_DELAY_S)
            except (OSError, ValueError) as e:  # urllib3 errors derive from OSError / ValueError
                logger.warning("EndpointSlice watch failed: %s; retrying", e)
                self._stop.wait(_RETRY_DELAY_S)

    def _list_and_watch(self, api: Any, serialize: Callable[[Any], Any], w: Any) -> None:
        cfg = self.config
        if cfg.namespace:
            list_fn: Callable[..., Any] = api.list_namespaced_endpoint_slice
            kwargs: dict[str, Any] = {"namespace": cfg.namespace, "label_selector": cfg.label_selector}
        else:
            list_fn = api.list_endpoint_slice_for_all_namespaces
            kwargs = {"label_selector": cfg.label_selector}
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
