"""LoRA adapters (pure): which pool each adapter name goes to, from what the replicas' `/v1/models`
list under their base model and what their LLMDeployments declare, and how well a replica suits an
adapter request (LoRA affinity)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from enum import IntEnum
from typing import Any

from corral_gateway.k8s_names import Naming, Route
from corral_gateway.registry import Replica
from corral_gateway.served_names import CARD_FIELDS

logger = logging.getLogger(__name__)


class Affinity(IntEnum):
    """A replica's place for an adapter request, best first (the Gateway API Inference Extension's
    LoRA affinity, as tiers)."""

    ACTIVE = 0  # it runs or queues requests of the adapter: no adapter to swap in
    FREE_SLOT = 1  # fewer distinct adapters active than it may run in one step (or not said)
    FULL = 2  # its adapter slots are taken: the request waits for one to free

    @property
    def label(self) -> str:
        return self.name.lower()


def takes_adapter(replica: Replica, adapter: str, declared: Collection[str]) -> bool:
    """Whether `replica` gets requests of `adapter`: it lists it, or it has not said what it serves
    yet and its deployment declares it (as it counts as serving its model's name until it says)."""
    return adapter in replica.adapters or (replica.served_names is None and adapter in declared)


def affinity(replica: Replica, adapter: str) -> Affinity:
    """Where `replica` stands for a request of `adapter`; one that reports no LoRA state counts
    as having a free slot (nothing says it is full)."""
    active = replica.active_adapters()
    if adapter in active:
        return Affinity.ACTIVE
    max_lora = replica.lora.max_lora if replica.lora is not None else None
    if max_lora is None or len(active) < max_lora:
        return Affinity.FREE_SLOT
    return Affinity.FULL


def adapters_of(listed: Mapping[str, Mapping[str, Any]], base: str) -> dict[str, dict[str, Any]]:
    """The entries of a `/v1/models` listing (id -> fields) whose `parent` is `base`: the replica's
    adapters of that model, each with what a listing passes on (its card fields and `root`)."""
    wanted = (*CARD_FIELDS, "root")
    return {
        name: {k: entry[k] for k in wanted if k in entry}
        for name, entry in listed.items()
        if name != base and entry.get("parent") == base
    }


class AdapterTable:
    """Adapter name -> a route per pool serving it: pools whose replicas list it, and pools whose
    LLMDeployments declare it (`Naming.adapters`: routed, woken and listed before any replica says);
    rebuilt when a replica's list changes, replicas come and go, or the names change. A name a
    client already means otherwise (a pool, an alias) is not taken over: `is_taken` says which, and
    each such name is warned about once."""

    def __init__(self) -> None:
        self._routes: dict[str, list[Route]] = {}
        self._declared: dict[str, frozenset[str]] = {}  # pool -> the adapters its deployments declare
        self._ambiguous: Mapping[str, list[str]] = {}  # declared in several namespaces -> qualified
        self._warned: set[str] = set()

    def rebuild(
        self,
        replicas: Iterable[Replica],
        is_taken: Callable[[str], bool],
        names: Naming,
        runtime: Mapping[str, Collection[str]] | None = None,
    ) -> None:
        """`runtime`: pool -> the adapters loaded on it through the gateway, routed (at zero
        replicas too) like declared ones, though no replica takes one before listing it."""
        routes: dict[str, set[Route]] = {}
        for replica in replicas:
            for name in replica.adapters:
                routes.setdefault(name, set()).add(Route(replica.model, name, adapter=name))
        for pool, loaded in (runtime or {}).items():
            for name in loaded:
                routes.setdefault(name, set()).add(Route(pool, name, adapter=name))
        declared: dict[str, set[str]] = {}
        for name, declared_routes in names.adapters.items():
            routes.setdefault(name, set()).update(declared_routes)
            for route in declared_routes:
                declared.setdefault(route.key, set()).add(route.upstream)
        self._routes = {name: sorted(rs, key=lambda r: r.key) for name, rs in routes.items()}
        self._declared = {pool: frozenset(adapters) for pool, adapters in declared.items()}
        self._ambiguous = names.ambiguous_adapters
        for name, name_routes in self._routes.items():
            keys = [r.key for r in name_routes]
            if name in self._warned or not self._is_listable(name, name_routes):
                continue  # a NAMESPACE/NAME of a bare name warned about (or fine): said once
            if is_taken(name):
                self._warned.add(name)
                logger.warning("adapter %r of %s is not routed: the name is a model's or an alias; "
                               "rename the adapter", name, ", ".join(map(repr, keys)))  # fmt: skip
            elif len(keys) > 1:
                self._warned.add(name)
                logger.warning("adapter %r is served for several models (%s); its requests are "
                               "refused until each has a name of its own", name, ", ".join(keys))  # fmt: skip

    def routes(self, name: str) -> list[Route]:
        """Where adapter `name` goes: one route per pool serving it (several: an ambiguous name)."""
        return self._routes.get(name, [])

    def pools(self) -> set[str]:
        """The pools some adapter routes to (listed, declared or loaded through the gateway)."""
        return {route.key for routes in self._routes.values() for route in routes}

    def choices(self, name: str) -> list[str]:
        """The NAMESPACE/NAME a client must use for an adapter declared in several namespaces."""
        return self._ambiguous.get(name, [])

    def declared(self, pool: str) -> frozenset[str]:
        """The adapters (as the engine serves them) the LLMDeployments of `pool` declare."""
        return self._declared.get(pool, frozenset())

    def names(self, is_taken: Callable[[str], bool]) -> list[str]:
        """The adapter names /v1/models lists: served for one pool, not taken, bare, or NAMESPACE/NAME
        where the bare name is declared in several namespaces (as pools are listed)."""
        return sorted(
            name
            for name, routes in self._routes.items()
            if len(routes) == 1 and not is_taken(name) and self._is_listable(name, routes)
        )

    def _is_listable(self, name: str, routes: list[Route]) -> bool:
        """A bare name (unless declared in several namespaces), or such a name's NAMESPACE/NAME."""
        upstream = routes[0].upstream
        return name not in self._ambiguous and (upstream == name or upstream in self._ambiguous)

    def entry(self, listed: str, upstream: str, replicas: Iterable[Replica], parent: str) -> dict[str, Any]:
        """`listed`'s entry in the gateway's /v1/models, as an engine lists an adapter: the first
        listing replica's fields (`root` as it said, or none) and `parent`, the base's public name."""
        card = next((r.adapters[upstream] for r in replicas if upstream in r.adapters), {})
        entry: dict[str, Any] = {"id": listed, "object": "model", "created": 0, "owned_by": "corral"}
        return entry | card | {"parent": parent}
