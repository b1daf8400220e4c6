"""The live fleet: registry + router + admission behind one narrow interface (models, leases,
health reports), fed by the replica pollers (`replica_poller.py`: load, probes, model lists),
response load headers and discovery updates. Runs the pollers and the per-replica gauges."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from corral_gateway.adapters import AdapterTable, Affinity, adapters_of, takes_adapter
from corral_gateway.admission import Admission
from corral_gateway.errors import AmbiguousAdapter, AmbiguousModel
from corral_gateway.k8s_discovery import Discovery
from corral_gateway.k8s_names import Naming, Route
from corral_gateway.k8s_wake import Waker
from corral_gateway.load import LoraState, parse_load_headers
from corral_gateway.loop_lag import LoopLag
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.policies import KvAware, make_policy
from corral_gateway.registry import Ejection, Registry, Replica, Saturation
from corral_gateway.replica_poller import ReplicaPollers
from corral_gateway.router import Router
from corral_gateway.runtime_adapters import RuntimeAdapters
from corral_gateway.served_names import CARD_FIELDS
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import Upstream

logger = logging.getLogger(__name__)

_GAUGE_INTERVAL_S = 0.5


class Fleet:
    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._registry = Registry(
            Ejection(settings.eject_after_failures, settings.ejection_s, settings.max_ejection_s)
        )
        self._registry.on_removed.append(self._forget_metrics)
        self.loop_lag = LoopLag(metrics.loop_lag, settings.connect_timeout_s)  # run by the app
        for model, urls in settings.backends.items():
            self._set_replicas(model, urls)
        self._static_models = set(settings.backends)
        self._discovered_models: set[str] = set()
        # Ready once Kubernetes discovery has listed replicas (static backends are known at once).
        self.is_synced = not settings.kubernetes.enabled
        saturation = Saturation(settings.saturation_max_waiting, settings.saturation_max_kv_usage_ratio)
        policy = make_policy(
            settings.policy,
            saturation,
            settings.affinity_load_factor,
            settings.affinity_vnodes,
            clock,
            settings.affinity_step_blocks_per_s,
            settings.affinity_queued_block_weight,
        )
        self._adapters = AdapterTable()
        self.runtime_adapters = RuntimeAdapters()  # loaded through the gateway (adapter_fanout.py)
        # Told the URL of a replica whose list lacks some of them (set by the app: it loads them).
        self.on_lacking_adapters: Callable[[str], None] | None = None
        self._router = Router(
            self._registry,
            policy,
            saturation,
            settings.load_max_age_s,
            clock,
            self._count_affinity,
            self._adapters.declared,
        )
        self._admission = Admission(self._router, settings.max_queue_len, settings.queue_timeout_s)
        # `async with fleet.lease(Ask(...)) as replica:` a replica, given back exactly once when the
        # block ends (Admission.lease).
        self.lease = self._admission.lease
        self._scorer = KvAware(saturation)
        self.waker: Waker | None = None  # set when Kubernetes discovery may wake models at zero
        self._names = Naming()  # served names and aliases from the LLMDeployments
        self.pollers = ReplicaPollers(self._registry, settings, clock, self, self._admission.pump_all)
        self._registry.on_removed.append(lambda _: self._index_adapters())

    # ---- what the proxy asks --------------------------------------------------------------------

    def models(self) -> list[str]:
        return self._registry.models()

    def has_model(self, model: str) -> bool:
        return self._registry.has_model(model)

    def stop_queueing(self) -> None:
        """The gateway is draining: queued requests get 503 `draining` now, later ones never queue."""
        self._admission.close()

    def has_candidates(self, model: str, exclude: Collection[str] = (), adapter: str | None = None) -> bool:
        """Whether some replica of `model` (listing `adapter`, if given) outside `exclude` is in
        rotation (a retry could go there)."""
        return bool(self._router.candidates(model, exclude, adapter))

    # ---- inputs -------------------------------------------------------------------------------

    def resolve(self, requested: str) -> Route:
        """The pool a requested name goes to and the name the engine serves it under; a name served
        in several namespaces must be qualified (AmbiguousModel lists the choices). A name no model
        or alias has may be a LoRA adapter a replica lists or an LLMDeployment declares: its base
        model's pool, sent under the adapter's own name (NAMESPACE/NAME too)."""
        if requested in self._static_models:
            return Route(requested, requested)
        route = self._names.routes.get(requested)
        if route is not None:
            return route
        choices = self._names.ambiguous.get(requested)
        if choices:
            raise AmbiguousModel(requested, choices)
        if not self._registry.has_model(requested):
            choices = self._adapters.choices(requested)  # declared in several namespaces
            if choices:
                raise AmbiguousModel(requested, choices)
            routes = self._adapters.routes(requested)
            if len(routes) > 1:
                raise AmbiguousAdapter(requested, [r.key for r in routes])
            if routes:
                return routes[0]
        return Route(requested, requested)

    def is_unserved(self, route: Route) -> bool:
        """Whether `route` names an adapter no replica of its pool takes while the pool has
        replicas, all of which have said what they serve (old replicas during a rollout adding it):
        its request would wait in the base model's queue for nothing, so it gets 404 as before."""
        replicas = self._registry.replicas(route.key)
        if route.adapter is None or not replicas or route.adapter in self.runtime_adapters.names(route.key):
            return False  # one loaded through the gateway is loaded on each replica lacking it
        declared = self._adapters.declared(route.key)
        return not any(takes_adapter(r, route.adapter, declared) for r in replicas)

    def is_taken(self, name: str) -> bool:
        """Whether a client asking for `name` means a model or an alias (an adapter may not take it)."""
        return (
            name in self._static_models
            or name in self._names.routes
            or name in self._names.ambiguous
            or self._registry.has_model(name)
        )

    def model_entry(self, listed: str) -> dict[str, Any]:
        """`listed`'s entry in the gateway's /v1/models: OpenAI's fields, with what its replicas'
        own entries say (max_model_len, created, owned_by; the first replica in rotation that has
        said), so a client sizing its prompts from the list finds the context length there too."""
        entry: dict[str, Any] = {"id": listed, "object": "model", "created": 0, "owned_by": "corral"}
        try:
            route = self.resolve(listed)
        except (AmbiguousModel, AmbiguousAdapter):
            return entry
        key = route.key
        replicas = sorted(self._registry.replicas(key), key=lambda r: not self.is_healthy(r))
        if route.adapter is not None:
            return self._adapters.entry(listed, route.adapter, replicas, key)
        card = next((r.model_card for r in replicas if r.model_card is not None), None)
        return entry | (card or {})

    def listed_models(self) -> list[str]:
        """What /v1/models lists: every pool (a served name, or NAMESPACE/NAME where the name is
        ambiguous), every alias of a known pool, and every adapter its replicas list or its
        LLMDeployments declare (at zero replicas too), once."""
        pools = set(self.models())
        aliases = {alias for alias, key in self._names.aliases.items() if key in pools}
        return sorted(pools | aliases | set(self._adapters.names(self.is_taken)))

    def apply_discovery(self, discovery: Discovery) -> None:
        """What Kubernetes discovery found: names first (a request never sees a pool without its
        names), then owners for waking, then pools; static backends stay as configured."""
        self._names = discovery.names
        if self.waker is not None:
            self.waker.set_owners(discovery.owners)
        self._apply_pools(discovery.pools)
        self._index_adapters()  # a name may have become a model's or an alias

    def _apply_pools(self, discovered: Mapping[str, list[str]]) -> None:
        for model, urls in discovered.items():
            if model in self._static_models:
                static = list(self.settings.backends[model])
                urls = static + [u for u in urls if u not in static]
            self._set_replicas(model, urls)
        for model in self._discovered_models - set(discovered) - self._static_models:
            self._registry.remove_model(model)
        self._discovered_models = set(discovered)
        self.is_synced = True
        logger.info("discovered replicas: %s", {m: len(u) for m, u in discovered.items()})
        self._admission.pump_all()

    def _set_replicas(self, model: str, urls: Iterable[str]) -> None:
        """Replicas appear here only: each gets its zero-valued metric series at once."""
        urls = list(urls)
        self._registry.set_replicas(model, urls)
        self.metrics.add_model(model)
        for url in urls:
            self.metrics.add_replica(model, url)

    def _forget_metrics(self, replica: Replica) -> None:
        """A replica left discovery: its metric series go with it."""
        is_url_gone = not self._registry.by_url(replica.url)
        self.metrics.forget_replica(replica.model, replica.url, is_url_gone)

    def is_current(self, replica: Replica) -> bool:
        """Whether `replica` is still in the fleet (not removed by discovery since it was leased)."""
        return any(r is replica for r in self._registry.by_url(replica.url))

    def wake_timeout_s(self, model: str) -> float | None:
        """For a model with no replica in rotation: ask the operator for one and return how long
        its requests may wait (None: the normal queue deadline applies)."""
        if self.waker is None or self._router.candidates(model):
            return None
        return self.settings.kubernetes.wake_timeout_s if self.waker.wake(model) else None

    def observe_headers(self, url: str, headers: Mapping[str, str]) -> None:
        sample = parse_load_headers(headers, self.clock())
        if sample is not None:
            self._registry.observe(url, sample)
        self.pollers.observe_headers(url, headers)  # a new models version: its list is read again

    def record_refusal(self, replica: Replica, retry_after_s: float, headers: Mapping[str, str]) -> None:
        """The replica answered that its own queue is full (`refusal.Refusal` says what may go
        there from now on); its answer's load headers tell how many requests it held."""
        now_s = self.clock()
        sample = parse_load_headers(headers, now_s)
        num_held = None if sample is None else sample.num_running + sample.num_waiting
        replica.refusal.refused(now_s, now_s + retry_after_s, num_held)

    def record_success(self, url: str) -> None:
        self._registry.record_success(url)

    def is_loop_stalled(self) -> bool:
        """Whether a connect timing out now did so because this gateway's event loop stalled over
        its span (a burst on a saturated machine), not because the replica did not answer: such a
        timeout is retried, but is not the replica's failure."""
        return self.loop_lag.is_stalled(self.settings.connect_timeout_s)

    def record_failure(self, url: str, reason: str) -> None:
        was_failing = {r.model for r in self._registry.by_url(url) if r.is_failing}
        if self._registry.record_failure(url, self.clock()):
            self.metrics.ejections.labels(url).inc()
            logger.warning("ejected replica %s after repeated failures (last: %s)", url, reason)
        for replica in self._registry.by_url(url):
            if replica.is_failing and not replica.is_ejected and replica.model not in was_failing:
                logger.warning("replica %s of model %s keeps failing (last: %s); kept in rotation as "
                               "the model's last replica there, it counts as unhealthy", url, replica.model,
                               reason)  # fmt: skip

    def observe_served_names(self, url: str, listed: Mapping[str, dict[str, Any]]) -> None:
        """What the replica at `url` serves (its /v1/models: id -> the entry's fields): its pool's
        name, and the LoRA adapters listed with that name as `parent`. A pool whose name is not
        among them is warned about once per change: its requests there get the engine's 404."""
        names = tuple(sorted(listed))
        is_adapters_changed = False
        for replica in self._registry.by_url(url):
            was_misnamed, is_changed = self.is_misnamed(replica), replica.served_names != names
            replica.served_names = names
            base = self.upstream_name(replica.model)
            card = listed.get(base)
            replica.model_card = None if card is None else {k: card[k] for k in CARD_FIELDS if k in card}
            adapters = adapters_of(listed, base)
            if adapters.keys() != replica.adapters.keys():
                is_adapters_changed = True
                logger.info("backend %r: replica %s lists adapters %s", replica.model, url,
                            ", ".join(map(repr, sorted(adapters))) or "none")  # fmt: skip
            replica.adapters = adapters
            served = ", ".join(repr(n) for n in names) or "no model"
            if self.is_misnamed(replica) and is_changed:
                logger.warning(
                    "backend %r: replica %s serves %s, not %r, so its requests get the engine's 404 "
                    "(fix the backend's model name or the engine's --served-model-name)",
                    replica.model, url, served, self.upstream_name(replica.model),
                )  # fmt: skip
            elif was_misnamed and not self.is_misnamed(replica):
                logger.info("backend %r: replica %s now serves %s", replica.model, url, served)
        if is_adapters_changed:
            self._index_adapters()
        replicas = self._registry.by_url(url)
        if self.on_lacking_adapters is not None and any(
            self.runtime_adapters.missing(r.model, r.adapters) for r in replicas
        ):
            self.on_lacking_adapters(url)

    def observe_lora(self, url: str, lora: LoraState) -> None:
        """The replica's running / waiting adapters, from its `vllm:lora_requests_info`."""
        for replica in self._registry.by_url(url):
            replica.lora = lora

    def _index_adapters(self) -> None:
        runtime = self.runtime_adapters.by_pool()
        self._adapters.rebuild(self._registry.all_replicas(), self.is_taken, self._names, runtime)
        for pool in self._adapters.pools():
            self.metrics.add_adapter_pool(pool)  # dashboards show 0 there, not "no data"

    def index_adapters(self) -> None:
        """The adapters loaded through the gateway changed: route them anew."""
        self._index_adapters()

    def replicas(self, pool: str) -> list[Replica]:
        return self._registry.replicas(pool)

    def replicas_at(self, url: str) -> list[Replica]:
        return self._registry.by_url(url)

    def adapter_pools(self, name: str) -> list[str]:
        """The pools adapter `name` routes to (listed, declared or loaded through the gateway)."""
        return [route.key for route in self._adapters.routes(name)]

    def lora_pools(self) -> list[str]:
        """Pools with LoRA on: an adapter routes there, or a replica reports LoRA (a Corral engine's
        models version header, vLLM's `vllm:lora_requests_info`)."""
        pools = self._adapters.pools()
        for replica in self._registry.all_replicas():
            if self.pollers.is_lora_enabled(replica.url):
                pools.add(replica.model)
        return sorted(pools)

    def _count_affinity(self, model: str, tier: Affinity) -> None:
        self.metrics.adapter_routes.labels(model, tier.label).inc()

    # ---- background I/O -----------------------------------------------------------------------

    async def run(self, upstream: Upstream) -> None:
        """Keep one poller per replica URL and refresh the per-replica gauges; runs until cancelled."""
        try:
            while True:
                self.pollers.sync(upstream, self._registry.urls())
                self.update_gauges()
                await asyncio.sleep(_GAUGE_INTERVAL_S)
        finally:
            await self.pollers.stop()

    def upstream_name(self, key: str) -> str:
        """The name the replicas of pool `key` are sent requests under (what they must serve)."""
        try:
            return self.resolve(key).upstream
        except AmbiguousModel:
            return key

    def is_misnamed(self, replica: Replica) -> bool:
        """The replica said what it serves, and it is not the name its pool's requests carry."""
        names = replica.served_names
        return names is not None and self.upstream_name(replica.model) not in names

    def is_healthy(self, replica: Replica) -> bool:
        """What `corral_gateway_replica_healthy` says: in rotation, not failing, serving its name."""
        return replica.is_answering and not self.is_misnamed(replica)

    def models_down(self) -> list[str]:
        """Models with replicas none of which is healthy (a model at zero replicas is not down:
        its requests wake one)."""
        return [
            model
            for model in self._registry.models()
            if (replicas := self._registry.replicas(model)) and not any(self.is_healthy(r) for r in replicas)
        ]

    def update_gauges(self) -> None:
        now_s = self.clock()
        for model in self._registry.models():
            self.metrics.queue_length.labels(model).set(self._admission.queue_len(model))
            replicas = self._registry.replicas(model)
            if not replicas:
                continue
            for replica, score in zip(replicas, self._scores(replicas, now_s), strict=True):
                replica.last_score = score
                self.metrics.replica_score.labels(model, replica.url).set(replica.last_score)
                self.metrics.replica_healthy.labels(model, replica.url).set(
                    1 if self.is_healthy(replica) else 0
                )
                self.metrics.replica_inflight.labels(model, replica.url).set(replica.num_inflight)

    def _scores(self, replicas: list[Replica], now_s: float) -> list[float]:
        """Each replica's kv-aware cost now (lower is better), as the gauge and traces show it."""
        loads = [r.load(now_s, self.settings.load_max_age_s) for r in replicas]
        max_running = max(load.num_running for load in loads)
        return [self._scorer.cost(load, max_running) for load in loads]

    def scores(self, model: str) -> dict[str, float]:
        replicas = self._registry.replicas(model)
        if not replicas:
            return {}
        return {r.url: s for r, s in zip(replicas, self._scores(replicas, self.clock()), strict=True)}

    def snapshot(self) -> dict[str, list[dict[str, object]]]:
        """Replica state for the /corral/replicas debug endpoint."""
        now_s = self.clock()
        out: dict[str, list[dict[str, object]]] = {}
        for model in self._registry.models():
            out[model] = []
            for r in self._registry.replicas(model):
                load = r.load(now_s, self.settings.load_max_age_s)
                serves = None if r.served_names is None else not self.is_misnamed(r)
                out[model].append(r.describe(now_s, load, is_healthy=self.is_healthy(r), serves_model=serves))
        return out
