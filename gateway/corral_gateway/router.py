"""Pick a replica for a request from live load: admission check, LoRA affinity for an adapter
request, then the routing policy (pure).

The clock is injected so the router stays I/O-free and testable.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from corral_gateway.adapters import Affinity, affinity, takes_adapter
from corral_gateway.policies import Candidate, Policy
from corral_gateway.registry import Registry, Replica, Saturation


@dataclass(frozen=True, slots=True)
class NoReplica:
    """Why no replica was picked: none usable (`is_saturated` False) or every one saturated."""

    is_saturated: bool


class Router:
    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        saturation: Saturation,
        max_age_s: float,
        clock: Callable[[], float],
        on_affinity: Callable[[str, Affinity], None] | None = None,
        declared: Callable[[str], Collection[str]] = lambda pool: (),
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.saturation = saturation
        self.max_age_s = max_age_s
        self.clock = clock
        # Told (pool, tier) for each adapter request routed: what the affinity achieved.
        self.on_affinity = on_affinity
        self.declared = declared  # pool -> the adapters its LLMDeployments declare
        registry.on_removed.append(self._forget)

    def _forget(self, replica: Replica) -> None:
        """A replica left: the policy drops what it kept about it (its URL's too, unless another
        model is still served there)."""
        self.policy.forget(replica, is_url_gone=not self.registry.by_url(replica.url))

    def candidates(
        self, model: str, exclude: Collection[str] = (), adapter: str | None = None
    ) -> list[Candidate]:
        """The model's replicas in rotation outside `exclude`; for an adapter request, only those
        that take the adapter (`takes_adapter`: another would answer 404)."""
        now_s = self.clock()
        declared = self.declared(model) if adapter is not None else ()
        return [
            Candidate(r, r.load(now_s, self.max_age_s))
            for r in self.registry.candidates(model)
            if r.url not in exclude and (adapter is None or takes_adapter(r, adapter, declared))
        ]

    def route(
        self,
        model: str,
        prefix_hash: int | None,
        exclude: Collection[str] = (),
        from_queue: bool = False,
        block_hashes: Sequence[int] = (),
        adapter: str | None = None,
    ) -> Replica | NoReplica:
        """A replica to send to (not yet marked dispatched), or why there is none. A request leaving
        the gateway's queue (`from_queue`) only goes where room remains after what was sent since
        the last load sample (`ReplicaLoad.is_full`). An adapter request goes to the best
        `Affinity` tier among the replicas with room (`_by_affinity`)."""
        candidates = self.candidates(model, exclude, adapter)
        if not candidates:
            return NoReplica(is_saturated=False)
        if from_queue:
            candidates = [c for c in candidates if not c.load.is_full(self.saturation)]
            if not candidates:
                return NoReplica(is_saturated=True)
        elif all(c.load.is_saturated(self.saturation) for c in candidates):
            return NoReplica(is_saturated=True)
        else:  # one that refuses would answer 429 again; some other is not saturated, so not refusing
            candidates = [c for c in candidates if not c.load.is_refusing]
        if adapter is not None:
            candidates = self._by_affinity(model, candidates, adapter)
        return self.policy.pick(candidates, prefix_hash, block_hashes).replica

    def _by_affinity(self, model: str, candidates: list[Candidate], adapter: str) -> list[Candidate]:
        """The unsaturated candidates of the best tier: where the adapter is active, else where a
        slot is free, else the rest; the policy then weighs their load (and prompt prefix) as for
        any request. Saturated ones only compete when all are (the policy's own fallback)."""
        roomy = [c for c in candidates if not c.load.is_saturated(self.saturation)] or candidates
        tiers = [affinity(c.replica, adapter) for c in roomy]
        best = min(tiers)
        if self.on_affinity is not None:
            self.on_affinity(model, best)
        return [c for c, tier in zip(roomy, tiers, strict=True) if tier == best]
