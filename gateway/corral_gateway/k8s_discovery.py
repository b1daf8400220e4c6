"""Kubernetes discovery: watch EndpointSlices (or Pods) selected by label, and the LLMDeployments
that own them, in every namespace or in each of a list; ready endpoints become replicas of the
deployment's served name (k8s_names.py), which with its aliases and declared LoRA adapters
routes there.

`discover` is the pure translation (tested without a cluster). The watcher runs the synchronous
`kubernetes` client in daemon threads and hands each new result to the event loop, so replicas and
names come and go without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corral_engine import wire

from corral_gateway.k8s_names import Naming, Served, naming, served_from_deployments
from corral_gateway.settings import KubernetesDiscovery

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_RETRY_DELAY_S = 1.0


@dataclass(frozen=True, slots=True)
class Discovery:
    """What discovery knows at one moment."""

    pools: dict[str, list[str]]  # registry key (a served name) -> sorted replica base URLs
    owners: dict[str, tuple[str, str]]  # key -> (namespace, LLMDeployment), for waking from zero
    names: Naming = field(default_factory=Naming)


def slice_urls(eps: Mapping[str, Any], port_name: str | None) -> list[str]:
    """An EndpointSlice's ready, non-terminating endpoints as base URLs."""
    port = _pick_port(eps.get("ports") or [], port_name)
    if port is None:
        return []
    urls = []
    for endpoint in eps.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        # The API says a missing `ready` means ready; terminating endpoints are never ready.
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses") or []
        if addresses:
            urls.append(_url(addresses[0], port, eps.get("addressType")))
    return urls


def pod_urls(pod: Mapping[str, Any], port_name: str | None) -> list[str]:
    """A Ready, non-terminating pod's base URL."""
    ports = [
        {"name": p.get("name"), "port": p.get("containerPort"), "protocol": p.get("protocol", "TCP")}
        for c in (pod.get("spec") or {}).get("containers") or []
        for p in c.get("ports") or []
    ]
    port = _pick_port(ports, port_name)
    if wire.is_pod_serving(pod) and port is not None:
        return [_url(pod["status"]["podIP"], port, None)]
    return []


def discover(
    objects: Iterable[Mapping[str, Any]],
    *,
    is_pods: bool,
    model_label: str,
    port_name: str | None,
    served: Iterable[Served] = (),
) -> Discovery:
    """Slices or pods -> pools keyed by served name. An object whose LLMDeployment is known goes to
    that deployment's pool; any other (a hand-made Service) to its model label's value (for slices,
    else the Service's name). A model scaled to zero keeps its (empty) pool, so its requests wake it
    instead of getting 404; `owners` are the deployments a request may wake (one per pool)."""
    served = list(served)
    names = naming(served)
    can_wake = {(s.namespace, s.deployment): s.can_wake for s in served}
    by_key: dict[str, set[str]] = {}
    owners: dict[str, tuple[str, str]] = {}
    # Every LLMDeployment is a pool, with replicas or not: at zero it may have no object at all
    # (pods discovery), and its requests must wake it, not get 404.
    for owner, pool in names.keys.items():
        by_key.setdefault(pool, set())
        if can_wake[owner]:
            owners.setdefault(pool, owner)
    for obj in objects:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        namespace, instance = meta.get("namespace"), labels.get(wire.INSTANCE_LABEL)
        key = names.keys.get((str(namespace), str(instance))) or labels.get(model_label)
        if not key and not is_pods:
            key = labels.get(SERVICE_NAME_LABEL)
        if not key:
            continue
        urls = by_key.setdefault(key, set())
        urls.update(pod_urls(obj, port_name) if is_pods else slice_urls(obj, port_name))
        owner = (str(namespace), str(instance))
        if namespace and instance and can_wake.get(owner, True):
            owners.setdefault(key, owner)
    pools = {key: sorted(urls) for key, urls in by_key.items()}
    return Discovery(pools, owners, names)


def replicas_from_slices(
    slices: Iterable[Mapping[str, Any]], model_label: str, port_name: str | None
) -> dict[str, list[str]]:
    """EndpointSlices (API JSON, camelCase) -> model label -> replica URLs (no LLMDeployments)."""
    return discover(slices, is_pods=False, model_label=model_label, port_name=port_name).pools


def replicas_from_pods(
    pods: Iterable[Mapping[str, Any]], model_label: str, port_name: str | None
) -> dict[str, list[str]]:
    """Pods (API JSON) -> model label -> replica URLs, Ready and not terminating only."""
    return discover(pods, is_pods=True, model_label=model_label, port_name=port_name).pools


def _pick_port(ports: Sequence[Mapping[str, Any]], port_name: str | None) -> int | None:
    usable = [p for p in ports if isinstance(p.get("port"), int) and p.get("protocol", "TCP") == "TCP"]
    named = [p for p in usable if port_name is not None and p.get("name") == port_name]
    pool = named or usable
    return int(pool[0]["port"]) if pool else None


def _url(address: str, port: int, address_type: str | None) -> str:
    host = f"[{address}]" if address_type == "IPv6" or ":" in address else address
    return f"http://{host}:{port}"


# One list + watch: a stream ("objects": the slices or pods; "deployments": the LLMDeployments)
# in one namespace, or in all of them (None).
Watch = tuple[str, str | None]


class KubernetesWatcher:
    """List + watch in daemon threads, one per stream and namespace (the slices or pods; the
    LLMDeployments when allowed); `on_change(Discovery)` runs on the event loop once every watch
    has listed."""

    def __init__(self, config: KubernetesDiscovery, on_change: Callable[[Discovery], None]) -> None:
        self.config = config
        self.on_change = on_change
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Each watch's objects by (namespace, name); a watch is here once it has listed.
        self._stores: dict[Watch, dict[tuple[str, str], dict[str, Any]]] = {}
        self._ambiguous: frozenset[str] = frozenset()

    def watches(self) -> list[Watch]:
        """Every (stream, namespace) to list and watch; None: every namespace in one watch."""
        streams = ["objects"] + (["deployments"] if self.config.read_llmdeployments else [])
        scopes: list[str | None] = list(self.config.namespaces) or [None]
        return [(stream, namespace) for stream in streams for namespace in scopes]

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for stream, namespace in self.watches():
            name = f"corral-k8s-{stream}-{namespace or 'all'}"
            threading.Thread(target=self._run, args=((stream, namespace),), name=name, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _objects_of(self, stream: str) -> list[dict[str, Any]]:
        return [obj for (s, _), store in self._stores.items() if s == stream for obj in store.values()]

    def _emit(self) -> None:
        with self._lock:
            if not set(self.watches()) <= self._stores.keys():
                return  # names known before replicas: no pool keyed by a label value first
            found = discover(
                self._objects_of("objects"),
                is_pods=self.config.source == "pods",
                model_label=self.config.model_label,
                port_name=self.config.port_name,
                served=served_from_deployments(self._objects_of("deployments")),
            )
            qualify = found.names.ambiguous_adapters | found.names.ambiguous  # adapters too
            ambiguous = frozenset(qualify)
            if ambiguous - self._ambiguous:
                choices = {n: qualify[n] for n in sorted(ambiguous - self._ambiguous)}
                logger.warning("served in several namespaces; clients must qualify them: %s", choices)
            self._ambiguous = ambiguous
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.on_change, found)

    def _run(self, target: Watch) -> None:
        import urllib3
        from kubernetes import client, config, watch

        try:
            if self.config.kubeconfig is not None:
                config.load_kube_config(config_file=str(self.config.kubeconfig))
            else:
                config.load_incluster_config()
        except (config.ConfigException, OSError) as e:
            logger.error("kubernetes discovery disabled: cannot load cluster config: %s", e)
            return
        serialize = client.ApiClient().sanitize_for_serialization
        stream, namespace = target
        scope = f"namespace {namespace}" if namespace else "all namespaces"
        while not self._stop.is_set():
            try:
                list_fn, kwargs = self._list_call(target, client)
                self._list_and_watch(target, list_fn, kwargs, serialize, watch.Watch())
            except client.ApiException as e:
                if stream == "deployments" and e.status == 403:
                    logger.warning(
                        "not allowed to read llmdeployments in %s: served names come from the %s label only",
                        scope,
                        self.config.model_label,
                    )
                    self._replace(target, {})
                    return
                if e.status == 403:  # not ready until every namespace lists: a missing Role shows
                    logger.error(
                        "not allowed to list %s in %s (the gateway needs a Role there); retrying",
                        self.config.source,
                        scope,
                    )
                else:
                    logger.warning("%s watch in %s ended (HTTP %s); re-listing", stream, scope, e.status)
                self._stop.wait(_RETRY_DELAY_S)
            except (OSError, ValueError, urllib3.exceptions.HTTPError) as e:
                # A refused connection (an API server restarting) is urllib3's MaxRetryError, no
                # OSError: uncaught, it ended this thread and the watch with it, for good.
                logger.warning("%s watch in %s failed: %s; retrying", stream, scope, e)
                self._stop.wait(_RETRY_DELAY_S)

    def _list_call(self, watch: Watch, client: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
        stream, namespace = watch
        cfg = self.config
        if stream == "deployments":
            api = client.CustomObjectsApi()
            kwargs: dict[str, Any] = {"group": wire.GROUP, "version": wire.VERSION, "plural": wire.PLURAL}
            if namespace:
                return api.list_namespaced_custom_object, {**kwargs, "namespace": namespace}
            return api.list_cluster_custom_object, kwargs
        api = client.CoreV1Api() if cfg.source == "pods" else client.DiscoveryV1Api()
        kind = "pod" if cfg.source == "pods" else "endpoint_slice"
        kwargs = {"label_selector": cfg.label_selector}
        if namespace:
            return getattr(api, f"list_namespaced_{kind}"), {**kwargs, "namespace": namespace}
        return getattr(api, f"list_{kind}_for_all_namespaces"), kwargs

    def _replace(self, watch: Watch, items: dict[tuple[str, str], dict[str, Any]]) -> None:
        with self._lock:
            self._stores[watch] = items
        self._emit()

    def _update(self, watch: Watch, event_type: str, obj: dict[str, Any]) -> None:
        with self._lock:
            store = self._stores[watch]  # listed first (_replace)
            if event_type == "DELETED":
                store.pop(_key(obj), None)
            else:
                store[_key(obj)] = obj
        self._emit()

    def _list_and_watch(
        self,
        watch: Watch,
        list_fn: Callable[..., Any],
        kwargs: dict[str, Any],
        serialize: Callable[[Any], Any],
        w: Any,
    ) -> None:
        listed = serialize(list_fn(**kwargs))  # custom objects come back as plain dicts already
        self._replace(watch, {_key(s): s for s in listed.get("items") or []})
        version = (listed.get("metadata") or {}).get("resourceVersion")
        stream_events = w.stream(
            list_fn, resource_version=version, timeout_seconds=self.config.watch_timeout_s, **kwargs
        )
        for event in stream_events:
            if self._stop.is_set():
                w.stop()
                return
            if event.get("type") == "ERROR":
                return  # e.g. 410 Gone: re-list
            self._update(watch, event["type"], serialize(event["object"]))


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace")), str(meta.get("name"))
