"""Routing policies: small classes behind one Protocol, chosen by name (pure, no I/O).

Admission (queue while every replica is saturated) happens before a policy runs, so a policy always
gets at least one candidate and at least one of them is not saturated.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from corral_gateway.prefill_ledger import PrefillLedger
from corral_gateway.prefix_index import PrefixIndex
from corral_gateway.registry import Replica, ReplicaLoad, Saturation

# Weights as in the Gateway API Inference Extension's default scorers: queue x2, KV x2.
QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0
RUNNING_WEIGHT = 1.0
PREFIX_WEIGHT = 3.0  # the llm-d scorer's prefix-cache weight
# Prefix affinity's price of waiting for a replica's steps, in prompt blocks a second: below the
# ~2,500 an H100 prefills for Llama-3-8B (25 us a token, ~15 tokens a block of 64 characters), so
# it leans on the cache and the load (simulated, 16-replica RAG bursty: 2,000-4,000 put 1-13 of
# 4,000 requests over the TPOT SLO, 1,500 none).
STEP_WAIT_BLOCKS_PER_S = 1500.0
# Prefix affinity: what a prompt's own blocks count for each request sent to the replica since its
# step in flight began (they have not started; its next step computes them with this prompt, so
# each waits for these blocks too). Simulated, corral profile: 16-replica RAG p99 lower in 8 of 10
# runs (5 seeds, both arrivals), all 12 cells in 28 of 36 (3 seeds); chat Poisson no gain.
QUEUED_BLOCK_WEIGHT = 1.0
_RING_WINDOW = 4096  # ring_order calls between drops of replicas no call asked for


@dataclass(frozen=True, slots=True)
class Candidate:
    replica: Replica
    load: ReplicaLoad


class Policy(Protocol):
    name: str

    def pick(
        self, candidates: Sequence[Candidate], prefix_hash: int | None, block_hashes: Sequence[int] = ()
    ) -> Candidate: ...

    def forget(self, replica: Replica, is_url_gone: bool) -> None:
        """`replica` left the registry (`is_url_gone`: no model is served at its URL any more)."""
        ...


class _Stateless:
    """Policies that keep nothing per replica."""

    def forget(self, replica: Replica, is_url_gone: bool) -> None:
        return None


class RoundRobin(_Stateless):
    name = "round-robin"

    def __init__(self, saturation: Saturation) -> None:
        self._next = 0

    def pick(
        self, candidates: Sequence[Candidate], prefix_hash: int | None, block_hashes: Sequence[int] = ()
    ) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.replica.url)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return chosen


class LeastRequests(_Stateless):
    """Fewest requests in flight from this gateway; ties rotate."""

    name = "least-requests"

    def __init__(self, saturation: Saturation) -> None:
        self._next = 0

    def pick(
        self, candidates: Sequence[Candidate], prefix_hash: int | None, block_hashes: Sequence[int] = ()
    ) -> Candidate:
        self._next += 1
        return _argmin_rotating(candidates, lambda c: float(c.load.num_inflight), self._next)


class KvAware(_Stateless):
    """Lowest cost from queue depth, KV usage and running count; saturated replicas only if all are."""

    name = "kv-aware"

    def __init__(self, saturation: Saturation) -> None:
        self._saturation = saturation
        self._next = 0

    def cost(self, load: ReplicaLoad, max_running: float) -> float:
        sat = self._saturation
        queue = load.num_waiting / max(1, sat.max_waiting)
        kv = load.kv_usage_ratio / sat.max_kv_usage_ratio
        running = load.num_running / (1.0 + max_running)
        return QUEUE_WEIGHT * queue + KV_WEIGHT * kv + RUNNING_WEIGHT * running

    def costs(self, candidates: Sequence[Candidate]) -> list[float]:
        max_running = max(c.load.num_running for c in candidates)
        return [self.cost(c.load, max_running) for c in candidates]

    def pick(
        self, candidates: Sequence[Candidate], prefix_hash: int | None, block_hashes: Sequence[int] = ()
    ) -> Candidate:
        self._next += 1
        pool = [c for c in candidates if not c.load.is_saturated(self._saturation)] or list(candidates)
        costs = dict(zip((id(c) for c in pool), self.costs(pool), strict=True))
        return _argmin_rotating(pool, lambda c: costs[id(c)], self._next)


class PrefixAffinity:
    """The replica where the prompt's first token comes soonest, as far as this gateway can tell.

    With the prompt's chained block hashes: the fewest blocks to prefill before it, counting the
    prompt's own blocks the replica has not cached (`PrefixIndex`: those this gateway did not send
    it) and the prefill already heading there (`PrefillLedger`: uncached blocks sent to it whose
    first token has not come back, and a reported queue beyond them at the mean request's blocks;
    the caller counts first bytes with `Replica.on_first_byte`). The prompt's own blocks count
    `own_block_weight` (2) times: this request waits for them and so does every request that comes
    after it on that replica, while pending prefill is work the fleet does either way. So a cached
    document is worth twice the prefill it saves, and a replica holding it loses the request only
    once the prefill piled on it outweighs that, instead of the fleet computing the document again
    whenever its holder is busy (simulated 16-replica RAG, roofline profile, bursty at 0.85 x: 67 %
    of requests in the SLO with 1 x, 99.9 % with 2 x). They count `queued_block_weight` (1) more
    for each request the ledger holds that was sent there since its step in flight began (its
    `StepPhase`): that one has not started, the replica's next step computes it with this prompt,
    and it waits for these blocks too; a cached question otherwise drew a cold document into its
    step, 100 ms for a 10 ms prompt. The wait for the replica's step in flight
    to end and for one step more (`StepPhase`, from the times its streams' chunks were relayed;
    the caller feeds it on `clock`) counts too, at `step_wait_blocks_per_s` blocks a second (0
    leaves it out): a cold prompt goes to a replica about to start its next step, and with a light
    batch, rather than one that just began a 30 ms step. Ties (nothing cached anywhere, nothing
    pending, phases unknown) go to kv-aware's order. Saturated replicas are left out, and so are
    those above `load_factor` x the mean load (bounded loads), unless that leaves none: affinity
    may not pile sessions onto one replica.

    Without a chain (a caller that computed only the hash of the first blocks): consistent hashing
    with the same bounds, a home queueing while another replica runs without a queue passing the
    request on: every gateway builds the same ring from the replica URLs, so gateways agree on a
    prompt's home without sharing state; a saturated home hands the request to kv-aware.
    """

    name = "prefix-affinity"

    def __init__(
        self,
        saturation: Saturation,
        load_factor: float = 1.25,
        vnodes: int = 64,
        own_block_weight: float = 2.0,
        step_wait_blocks_per_s: float = STEP_WAIT_BLOCKS_PER_S,
        clock: Callable[[], float] = time.monotonic,
        queued_block_weight: float = QUEUED_BLOCK_WEIGHT,
    ) -> None:
        self._saturation = saturation
        self._load_factor = load_factor
        self._own_block_weight = own_block_weight
        self._queued_block_weight = queued_block_weight
        self._step_wait_blocks_per_s = step_wait_blocks_per_s
        self._clock = clock
        self._vnodes = vnodes
        self._fallback = KvAware(saturation)
        self.index = PrefixIndex()
        self.ledger = PrefillLedger()
        self._ring_urls: frozenset[str] = frozenset()
        self._ring: list[tuple[int, str]] = []
        self._window_urls: set[str] = set()  # every URL asked for since the window began
        self._num_ring_calls = 0
        self._next = 0

    def ring_order(self, urls: Sequence[str], prefix_hash: int) -> list[str]:
        """Distinct replica URLs in ring order, starting at the prefix's point."""
        wanted = set(urls)
        self._ensure_ring(wanted)
        start = bisect.bisect_left(self._ring, (prefix_hash, ""))
        order: list[str] = []
        seen: set[str] = set()
        for i in range(len(self._ring)):
            url = self._ring[(start + i) % len(self._ring)][1]
            if url in wanted and url not in seen:
                seen.add(url)
                order.append(url)
                if len(order) == len(wanted):
                    break
        return order

    def _ensure_ring(self, urls: set[str]) -> None:
        """A ring over at least `urls`. A replica's points do not depend on the others', so the
        ring of a subset is a bigger ring with the others skipped: under load the candidates change
        from request to request (queued requests see only replicas with room), and rebuilding the
        ring per set (64 x 64 hashes and a sort) took a quarter of the gateway's CPU at 1,000
        streams on 64 replicas. A new URL rebuilds it with the old ones kept; every
        `_RING_WINDOW` calls, replicas nobody asked for in the window leave it (the fleet shrank)."""
        self._num_ring_calls += 1
        self._window_urls |= urls
        if not urls <= self._ring_urls:
            self._build_ring(self._ring_urls | urls)
        elif self._num_ring_calls % _RING_WINDOW == 0:
            if len(self._window_urls) < len(self._ring_urls):
                self._build_ring(self._window_urls)
            self._window_urls = set()

    def _build_ring(self, urls: Collection[str]) -> None:
        self._ring_urls = frozenset(urls)
        self._ring = sorted((_hash64(f"{url}#{i}"), url) for url in urls for i in range(self._vnodes))

    def pick(
        self, candidates: Sequence[Candidate], prefix_hash: int | None, block_hashes: Sequence[int] = ()
    ) -> Candidate:
        if block_hashes:
            return self._pick_by_prefill(candidates, block_hashes)
        return self._pick_on_ring(candidates, prefix_hash)

    def blocks_to_prefill(self, candidates: Sequence[Candidate], block_hashes: Sequence[int]) -> list[float]:
        """Per candidate: the prompt's blocks it lacks (x `own_block_weight`, + `queued_block_weight`
        per request sent there since its step in flight began) plus the prefill already heading there."""
        matched = self.index.matched_blocks([c.replica.url for c in candidates], block_hashes)
        own, queued = self._own_block_weight, self._queued_block_weight
        costs = []
        for c in candidates:
            phase = c.replica.step_phase
            # Steps seen (a long one may still run), or nothing counts as not started.
            since_s = phase.last_step_end_s if queued > 0.0 and phase.step_s > 0.0 else math.inf
            pending, num_queued = self.ledger.pending(c.replica, c.load, since_s)
            missing = len(block_hashes) - matched[c.replica.url]
            costs.append((own + queued * num_queued) * missing + pending)
        return costs

    def forget(self, replica: Replica, is_url_gone: bool) -> None:
        self.ledger.forget(replica)
        if is_url_gone:
            self.index.forget(replica.url)

    def step_waits_s(self, candidates: Sequence[Candidate]) -> list[float]:
        """Per candidate: how long its steps hold a prompt sent now from its first token, its own
        prefill left out: the rest of the step in flight (`StepPhase`) and one step more, since the
        prompt's step also carries the replica's batch (a heavier batch, longer steps). 0 for a
        replica running nothing; where the phase is unknown, the known ones' mean."""
        now_s = self._clock()
        waits: list[float | None] = []
        for c in candidates:
            if c.load.num_running < 1:
                waits.append(0.0)
                continue
            phase = c.replica.step_phase
            left_s = phase.time_left_s(now_s)
            waits.append(None if left_s is None else left_s + phase.step_s)
        known = [w for w in waits if w is not None]
        unknown_s = sum(known) / len(known) if known else 0.0
        return [unknown_s if w is None else w for w in waits]

    def _pick_by_prefill(self, candidates: Sequence[Candidate], block_hashes: Sequence[int]) -> Candidate:
        pool = [c for c in candidates if not c.load.is_saturated(self._saturation)] or list(candidates)
        bound = self._load_bound(candidates)
        pool = [c for c in pool if c.load.num_outstanding + 1 <= bound] or pool
        blocks = self.blocks_to_prefill(pool, block_hashes)
        costs = self._fallback.costs(pool)
        self._next += 1
        if self._step_wait_blocks_per_s > 0.0:
            rate = self._step_wait_blocks_per_s
            blocks = [b + rate * w for b, w in zip(blocks, self.step_waits_s(pool), strict=True)]
        keys = {id(c): (b, k) for c, b, k in zip(pool, blocks, costs, strict=True)}
        best = min(keys.values())
        ties = sorted((c for c in pool if keys[id(c)] <= best), key=lambda c: c.replica.url)
        chosen = ties[self._next % len(ties)]
        matched = self.index.matched_blocks([chosen.replica.url], block_hashes)[chosen.replica.url]
        # At least one block: a fully cached prompt still computes its last tokens.
        self.ledger.record(chosen.replica, max(1, len(block_hashes) - matched), self._clock())
        self.index.remember(chosen.replica.url, block_hashes)
        return chosen

    def _load_bound(self, candidates: Sequence[Candidate]) -> int:
        """Bounded loads: the most requests a replica may hold, this one included."""
        total = sum(c.load.num_outstanding for c in candidates)
        return math.ceil(self._load_factor * (total + 1) / len(candidates))

    def _pick_on_ring(self, candidates: Sequence[Candidate], prefix_hash: int | None) -> Candidate:
        if prefix_hash is None or len(candidates) == 1:
            return self._fallback.pick(candidates, prefix_hash)
        by_url = {c.replica.url: c for c in candidates}
        order = self.ring_order(list(by_url), prefix_hash)
        if by_url[order[0]].load.is_saturated(self._saturation):
            return self._fallback.pick(candidates, prefix_hash)
        someone_has_a_seat = any(_runs_at_once(c.load) for c in candidates)
        bound = self._load_bound(candidates)
        for url in order:
            load = by_url[url].load
            if load.is_saturated(self._saturation) or load.num_outstanding + 1 > bound:
                continue
            if not someone_has_a_seat or _runs_at_once(load):
                return by_url[url]
        return self._fallback.pick(candidates, prefix_hash)


class LlmdScorer:
    """The llm-d inference scheduler's default mix, re-implemented as the peer to compare with:
    saturated replicas filtered out (unless all are), then 2 x queue + 2 x KV + 3 x prefix, the
    highest score wins, ties at random. queue: (max - q) / (max - min) of the waiting counts; KV:
    1 - usage; prefix: the share of the prompt's blocks, from its start, that this gateway last sent
    to the replica (`PrefixIndex`, 31,250 blocks per replica)."""

    name = "llm-d"

    def __init__(self, saturation: Saturation, lru_blocks: int = 31_250, seed: int = 0) -> None:
        self._saturation = saturation
        self.index = PrefixIndex(lru_blocks)
        self._rng = random.Random(seed)

    def forget(self, replica: Replica, is_url_gone: bool) -> None:
        if is_url_gone:
            self.index.forget(replica.url)

    def prefix_scores(self, urls: Sequence[str], block_hashes: Sequence[int]) -> dict[str, float]:
        matched = self.index.matched_blocks(urls, block_hashes)
        return {url: n / len(block_hashes) if block_hashes else 0.0 for url, n in matched.items()}

    def pick(
        self, candidates: Sequence[Candidate], prefix_hash: int | None, block_hashes: Sequence[int] = ()
    ) -> Candidate:
        pool = [c for c in candidates if not c.load.is_saturated(self._saturation)] or list(candidates)
        queues = [c.load.num_waiting_reported for c in pool]
        low, high = min(queues), max(queues)
        prefix = self.prefix_scores([c.replica.url for c in pool], block_hashes)
        scores = [
            QUEUE_WEIGHT * ((high - q) / (high - low) if high > low else 1.0)
            + KV_WEIGHT * (1.0 - c.load.kv_usage_ratio_reported)
            + PREFIX_WEIGHT * prefix[c.replica.url]
            for c, q in zip(pool, queues, strict=True)
        ]
        best = max(scores)
        chosen = self._rng.choice([c for c, s in zip(pool, scores, strict=True) if s >= best - 1e-9])
        self.index.remember(chosen.replica.url, block_hashes)
        return chosen


def _runs_at_once(load: ReplicaLoad) -> bool:
    """No request queued on the replica (as last reported, plus what was sent since), as far as
    the gateway knows: one more probably starts at the engine's next step."""
    return load.num_waiting < 1


def _argmin_rotating(
    candidates: Sequence[Candidate], key: Callable[[Candidate], float], offset: int
) -> Candidate:
    """The lowest-key candidate; among equals, rotate so ties spread instead of herding."""
    ordered = sorted(candidates, key=lambda c: c.replica.url)
    best = min(key(c) for c in ordered)
    ties = [c for c in ordered if key(c) <= best + 1e-9]
    return ties[offset % len(ties)]


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastRequests.name: LeastRequests,
    KvAware.name: KvAware,
    PrefixAffinity.name: PrefixAffinity,
    LlmdScorer.name: LlmdScorer,
}


def make_policy(
    name: str,
    saturation: Saturation,
    load_factor: float = 1.25,
    vnodes: int = 64,
    clock: Callable[[], float] = time.monotonic,
    step_wait_blocks_per_s: float = STEP_WAIT_BLOCKS_PER_S,
    queued_block_weight: float = QUEUED_BLOCK_WEIGHT,
) -> Policy:
    """`clock`: the one the caller passes `StepPhase.on_chunk` its times on."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    if name == PrefixAffinity.name:
        return PrefixAffinity(
            saturation,
            load_factor=load_factor,
            vnodes=vnodes,
            step_wait_blocks_per_s=step_wait_blocks_per_s,
            clock=clock,
            queued_block_weight=queued_block_weight,
        )
    return POLICIES[name](saturation)
