"""Queue-aware admission: lease out replicas, holding requests in a bounded per-model queue while
every replica of the model is saturated. Waiters are woken by `pump` when load changes."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from corral_gateway.disconnect import race
from corral_gateway.errors import Draining, RateLimited, ReplicasUnavailable, Unavailable
from corral_gateway.fair_queue import FairQueue
from corral_gateway.registry import Replica
from corral_gateway.router import NoReplica, Router

logger = logging.getLogger(__name__)

# Told to clients whose request found the queue full; about how long a short request takes.
QUEUE_FULL_RETRY_AFTER_S = 1.0


def _queue_full(model: str) -> RateLimited:
    return RateLimited(
        f"Too many requests queued for model `{model}`; retry later.",
        retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
        code="queue_full",
    )


@dataclass(eq=False, slots=True)
class _Waiter:
    future: asyncio.Future[Replica]
    prefix_hash: int | None
    exclude: frozenset[str] = field(default_factory=frozenset)
    block_hashes: tuple[int, ...] = ()
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class Ask:
    """One request's claim on a replica: its model (the pool), its prompt prefix (for affinity), its
    place in the queue, the replicas it must not get again, how long it may wait (None: the
    default), and the LoRA adapter it asks for (None: the base model)."""

    model: str
    prefix_hash: int | None = None
    priority: int = 0
    fairness_key: str = ""
    exclude: Collection[str] = ()
    timeout_s: float | None = None
    block_hashes: tuple[int, ...] = ()  # the prompt's chained block hashes (for the llm-d scorer)
    adapter: str | None = None


class Admission:
    def __init__(self, router: Router, max_queue_len: int, timeout_s: float) -> None:
        self.router = router
        self.max_queue_len = max_queue_len
        self.timeout_s = timeout_s
        self._queues: dict[str, FairQueue[_Waiter]] = {}
        self.is_closed = False  # the gateway is draining: nothing queues any more

    def queue_len(self, model: str) -> int:
        queue = self._queues.get(model)
        return len(queue) if queue is not None else 0

    @asynccontextmanager
    async def lease(self, ask: Ask, disconnect: asyncio.Future[None] | None = None) -> AsyncIterator[Replica]:
        """A replica for the `async with` block, given back exactly once when the block ends, however
        it ends (return, error, cancellation). Waits in the queue when the fleet is saturated; a
        `disconnect` that completes first ends the wait with ClientGone, and a replica handed out
        just then goes straight back."""
        replica = self.try_acquire(ask.model, ask.prefix_hash, ask.exclude, ask.block_hashes, ask.adapter)
        release = functools.partial(self.release, adapter=ask.adapter)
        if replica is None:
            waiting = self.acquire(ask)
            replica = await (waiting if disconnect is None else race(waiting, disconnect, release))
        try:
            yield replica
        finally:
            release(replica)

    async def acquire(self, ask: Ask) -> Replica:
        """A replica already marked dispatched; the caller must `release` it when done (`lease`
        does both)."""
        model = ask.model
        timeout_s = self.timeout_s if ask.timeout_s is None else ask.timeout_s
        replica = self.try_acquire(model, ask.prefix_hash, ask.exclude, ask.block_hashes, ask.adapter)
        if replica is not None:
            return replica
        if self.is_closed:
            raise Draining()
        queue = self._queues[model]
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(
            future, ask.prefix_hash, frozenset(ask.exclude), tuple(ask.block_hashes), ask.adapter
        )
        evicted = queue.evict_for(ask.priority, ask.fairness_key)
        if evicted is not None and not evicted.future.done():
            # The key holding most of the queue gives up its newest place: one API key's burst
            # cannot shut every other key out of a model's queue.
            evicted.future.set_exception(_queue_full(model))
        if not queue.push(waiter, ask.priority, ask.fairness_key):
            raise _queue_full(model)
        self.pump(model)
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=timeout_s)
        except asyncio.CancelledError:
            self._abandon(model, waiter)
            raise
        if not done:
            self._abandon(model, waiter)
            raise Unavailable(
                f"No replica of model `{model}` could take the request within {timeout_s:g} s.",
                retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
                code="queue_timeout",
            )
        return waiter.future.result()

    def try_acquire(
        self,
        model: str,
        prefix_hash: int | None,
        exclude: Collection[str] = (),
        block_hashes: tuple[int, ...] = (),
        adapter: str | None = None,
    ) -> Replica | None:
        """The fast path, without waiting: a dispatched replica, or None when the request must queue."""
        queue = self._queues.setdefault(model, FairQueue(self.max_queue_len))
        if queue:
            return None  # others are waiting: queue behind them
        routed = self.router.route(model, prefix_hash, exclude, block_hashes=block_hashes, adapter=adapter)
        if isinstance(routed, Replica):
            routed.on_dispatch(adapter)
            return routed
        if exclude and not routed.is_saturated:
            raise ReplicasUnavailable(model)  # every replica left failed this request
        return None

    def close(self) -> None:
        """The gateway is draining: every queued request is answered 503 `draining` now (none
        will be dispatched before the drain ends), and none queues from now on."""
        self.is_closed = True
        for queue in self._queues.values():
            while (waiter := queue.pop()) is not None:
                if not waiter.future.done():
                    waiter.future.set_exception(Draining())

    def _abandon(self, model: str, waiter: _Waiter) -> None:
        self._queues[model].remove(waiter)
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result(), waiter.adapter)  # handed a replica just as the caller gave up
        else:
            waiter.future.cancel()

    def release(self, replica: Replica, adapter: str | None = None) -> None:
        replica.on_done(adapter)
        self.pump(replica.model)

    def pump(self, model: str) -> None:
        """Hand replicas to queued waiters, in the queue's order, while some replica has room. A
        waiter only some replicas may take (an adapter's, or one excluding replicas that failed it)
        is passed over while none of those has room: it keeps its place (`FairQueue.hold`) and goes
        first when one has, and the waiters behind it are served meanwhile."""
        queue = self._queues.get(model)
        # What no replica with room takes in this pump, as (adapter, exclude): each hand-out only
        # adds load, so it stays so until the pump ends.
        blocked: set[tuple[str | None, frozenset[str]]] = set()
        while queue and self._pump_once(model, queue, blocked):
            pass

    def _pump_once(
        self, model: str, queue: FairQueue[_Waiter], blocked: set[tuple[str | None, frozenset[str]]]
    ) -> bool:
        """One walk down the queue's order; True when it stopped at a waiter it newly held, whose
        key's turns now go to the key's other waiters: the order changed, walk it again."""
        for waiter in queue.ordered():
            if waiter.future.done():
                queue.remove(waiter)
                continue
            needs = (waiter.adapter, waiter.exclude)
            routed = NoReplica(is_saturated=True) if needs in blocked else self._route(model, waiter)
            if isinstance(routed, Replica):
                queue.take(waiter)
                routed.on_dispatch(waiter.adapter)
                waiter.future.set_result(routed)
            elif needs == (None, frozenset()):
                return False  # any replica may take it: none has room for anyone
            else:
                blocked.add(needs)
                if queue.hold(waiter):
                    return True
        return False

    def _route(self, model: str, waiter: _Waiter) -> Replica | NoReplica:
        return self.router.route(
            model,
            waiter.prefix_hash,
            waiter.exclude,
            from_queue=True,
            block_hashes=waiter.block_hashes,
            adapter=waiter.adapter,
        )

    def pump_all(self) -> None:
        for model in list(self._queues):
            self.pump(model)
