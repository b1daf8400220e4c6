"""LoRA adapters (pure): which pool each adapter name goes to, from what the replicas' `/v1/models`
list under their base model, and how well a replica suits an adapter request (LoRA affinity)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from enum import IntEnum
from typing import Any

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
    """Adapter name -> the pools whose replicas list it; rebuilt when a replica's list changes or
    replicas come and go. A name a client already means otherwise (a pool, an alias) is not taken
    over: `is_taken` says which, and each such name is warned about once."""

    def __init__(self) -> None:
        self._pools: dict[str, list[str]] = {}
        self._warned: set[str] = set()

    def rebuild(self, replicas: Iterable[Replica], is_taken: Callable[[str], bool]) -> None:
        pools: dict[str, set[str]] = {}
        for replica in replicas:
            for name in replica.adapters:
                pools.setdefault(name, set()).add(replica.model)
        self._pools = {name: sorted(keys) for name, keys in pools.items()}
        for name, keys in self._pools.items():
            if name in self._warned:
                continue
            if is_taken(name):
                self._warned.add(name)
                logger.warning("adapter %r of %s is not routed: the name is a model's or an alias; "
                               "rename the adapter", name, ", ".join(map(repr, keys)))  # fmt: skip
            elif len(keys) > 1:
                self._warned.add(name)
                logger.warning("adapter %r is listed under several models (%s); its requests are "
                               "refused until each has a name of its own", name, ", ".join(keys))  # fmt: skip

    def pools(self, name: str) -> list[str]:
        """The pools whose replicas list adapter `name` (several: an ambiguous name)."""
        return self._pools.get(name, [])

    def names(self, is_taken: Callable[[str], bool]) -> list[str]:
        """The adapter names a client may ask for: listed under one pool, not taken."""
        return sorted(n for n, keys in self._pools.items() if len(keys) == 1 and not is_taken(n))

    def entry(self, name: str, replicas: Iterable[Replica], parent: str) -> dict[str, Any]:
        """`name`'s entry in the gateway's /v1/models, as an engine lists an adapter: the first
        listing replica's fields (`root` as it said, or none) and `parent`, the base's public name."""
        card = next((r.adapters[name] for r in replicas if name in r.adapters), {})
        entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "corral"}
        return entry | card | {"parent": parent}
