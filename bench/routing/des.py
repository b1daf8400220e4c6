"""A simulated fleet on a virtual clock: the gateway's own router, registry and policies in front of
simulated engines (the engine's real scheduler, block manager and prefix cache), events in time order.

What the gateway does, restated without I/O: route on arrival (queue FIFO while every replica is
saturated), poll each replica's load every `poll_interval_s` (each on its own phase), read the load
headers of a response and count its first byte as its first token arrives, see a replica's
streams' chunks at each of its step ends that gives any request a token (`Replica.step_phase`),
and hand queued requests out after each poll and each finished request. With LoRA (`FleetLora`), each
poll also reads the replica's running and waiting adapters, and adapter requests are routed by the
router's LoRA affinity (or, to measure it, without). With `pooling` the replicas serve an embedding
model: each request is prompt-only and ends, first byte and last, at the step that completes its
prompt (`SimRequest.output_len` is not read). Network and gateway latency are not
modelled (the gateway bench measures them). A run of minutes of fleet time takes seconds to a
minute of CPU.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from corral_engine.lora import LoraRequest
from corral_engine.outputs import EngineStats
from corral_engine.pooling_params import PoolingParams
from corral_engine.sampling_params import SamplingParams
from corral_engine.sim.embedding import SimPooling
from corral_engine.sim.engine import NullTokenizer, SimEngine, SimStep
from corral_engine.sim.lora_cost import LoraCost
from corral_engine.sim.perf_model import Profile
from corral_gateway.adapters import Affinity
from corral_gateway.load import LoadSample, LoraState
from corral_gateway.policies import QUEUED_BLOCK_WEIGHT, STEP_WAIT_BLOCKS_PER_S, make_policy
from corral_gateway.registry import Registry, Replica, Saturation
from corral_gateway.router import NoReplica, Router

from bench.routing.sim_workloads import SimRequest
from bench.routing.ttft_breakdown import Tracer

MODEL = "sim"


@dataclass(slots=True)
class Outcome:
    request_id: str
    arrival_s: float
    output_len: int
    is_counted: bool = True
    replica: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class GatewayModel:
    policy: str
    poll_interval_s: float = 0.075
    load_max_age_s: float = 2.0
    saturation: Saturation = field(default_factory=Saturation)
    step_blocks_per_s: float = STEP_WAIT_BLOCKS_PER_S  # prefix affinity's price of a step (0: off)
    queued_block_weight: float = QUEUED_BLOCK_WEIGHT  # prefix affinity's, per request not started (0: off)


@dataclass(frozen=True, slots=True)
class FleetLora:
    """LoRA on every replica: each lists `adapters`, runs at most `max_loras` of them at once and
    reports its running / waiting ones at each load poll (vLLM's `lora_requests_info` on /metrics).
    `is_affinity` False: the router is not told a request's adapter (no LoRA affinity)."""

    adapters: tuple[str, ...]
    max_loras: int = 4
    cost: LoraCost | None = None
    is_affinity: bool = True


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FleetSim:
    def __init__(
        self,
        profiles: list[Profile],
        gateway: GatewayModel,
        seed: int = 0,
        trace: bool = False,
        lora: FleetLora | None = None,
        pooling: SimPooling | None = None,
    ) -> None:
        """`trace`: keep where each request's time to first token went (`tracer`), at some CPU.
        `lora`: the replicas serve adapters (requests name theirs in `SimRequest.adapter`).
        `pooling`: the replicas serve this embedding model (--runner pooling)."""
        self.clock = _Clock()
        tokenizer = NullTokenizer()
        max_loras, cost = (lora.max_loras, lora.cost) if lora is not None else (0, None)
        self.engines = [
            SimEngine(
                p,
                tokenizer,
                MODEL,
                clock=self.clock,
                is_lean=True,
                max_loras=max_loras,
                lora_cost=cost,
                pooling=pooling,
            )
            for p in profiles
        ]
        self.is_pooling = pooling is not None  # its requests take PoolingParams
        self.urls = [f"http://replica-{i}" for i in range(len(profiles))]
        self._index = {url: i for i, url in enumerate(self.urls)}
        self.registry = Registry()
        self.registry.set_replicas(MODEL, self.urls)
        self.lora = lora
        names = lora.adapters if lora is not None else ()
        self._loras = {name: LoraRequest(name, k + 1, "") for k, name in enumerate(names)}
        for replica in self.registry.replicas(MODEL):
            replica.adapters = {name: {} for name in names}
        self.affinity_counts: Counter[Affinity] = Counter()  # adapter requests routed, by tier
        policy = make_policy(
            gateway.policy,
            gateway.saturation,
            clock=self.clock,
            step_wait_blocks_per_s=gateway.step_blocks_per_s,
            queued_block_weight=gateway.queued_block_weight,
        )
        self.router = Router(
            self.registry,
            policy,
            gateway.saturation,
            gateway.load_max_age_s,
            self.clock,
            on_affinity=lambda _, tier: self.affinity_counts.update((tier,)),
        )
        self.gateway = gateway
        self._replicas = {r.url: r for r in self.registry.replicas(MODEL)}
        self._steps: list[SimStep | None] = [None] * len(profiles)
        self._step_ends_s = [0.0] * len(profiles)
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._queue: deque[SimRequest] = deque()
        self._pending = 0  # submitted and not finished
        self._rng = random.Random(seed)
        self.outcomes: dict[str, Outcome] = {}
        self.max_queue_len = 0
        self.stats_at_mark: list[EngineStats] | None = None  # the engines' counters at `mark_s`
        self.on_finish: Callable[[Outcome], None] | None = None  # may `submit` more requests
        self.tracer = Tracer(self.engines) if trace else None

    # -- events ---------------------------------------------------------------------------------
    def _at(self, when_s: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (when_s, next(self._seq), kind, payload))

    def submit(self, request: SimRequest) -> None:
        """Send `request` at its arrival time (now, if that has passed)."""
        self._pending += 1
        self._at(max(self.clock.now, request.arrival_s), "arrive", request)

    def run(self, requests: list[SimRequest], mark_s: float | None = None) -> dict[str, Outcome]:
        """Every request to its end. `mark_s`: copy the engines' counters then (`stats_at_mark`),
        so a warm-up's prefix hits and preemptions can be told from the rest's."""
        self._pending = 0
        for r in requests:
            self.submit(r)
        if mark_s is not None:
            self._at(mark_s, "mark", None)
        for i in range(len(self.engines)):
            self._at(self._rng.uniform(0, self.gateway.poll_interval_s), "poll", i)
        while self._events and self._pending:
            when_s, _, kind, payload = heapq.heappop(self._events)
            self.clock.now = when_s
            if kind == "arrive":
                self._arrive(payload)  # type: ignore[arg-type]
            elif kind == "mark":
                self.stats_at_mark = [e.stats() for e in self.engines]  # snapshots
            elif kind == "step":
                num_finished = self._step_done(payload)  # type: ignore[arg-type]  # may submit more
                self._pending -= num_finished
            else:
                self._poll(payload)  # type: ignore[arg-type]
        return self.outcomes

    def _arrive(self, request: SimRequest) -> None:
        self.outcomes[request.request_id] = Outcome(
            request.request_id,
            request.arrival_s,
            request.output_len,
            request.is_counted,
            adapter=request.adapter,
        )
        if self._queue:
            self._enqueue(request)
            return
        routed = self.router.route(
            MODEL,
            request.prefix_hash,
            block_hashes=request.block_hashes,
            adapter=self._routed_adapter(request),
        )
        if isinstance(routed, NoReplica):
            self._enqueue(request)
        else:
            self._dispatch(request, routed)

    def _enqueue(self, request: SimRequest) -> None:
        self._queue.append(request)
        self.max_queue_len = max(self.max_queue_len, len(self._queue))

    def _pump(self) -> None:
        while self._queue:
            request = self._queue[0]
            routed = self.router.route(
                MODEL,
                request.prefix_hash,
                from_queue=True,
                block_hashes=request.block_hashes,
                adapter=self._routed_adapter(request),
            )
            if isinstance(routed, NoReplica):
                return
            self._queue.popleft()
            self._dispatch(request, routed)

    def _routed_adapter(self, request: SimRequest) -> str | None:
        """The adapter the router is told of: none without LoRA affinity (every replica lists
        every adapter here, so it only decides the affinity tiers)."""
        return request.adapter if self.lora is not None and self.lora.is_affinity else None

    def _dispatch(self, request: SimRequest, replica: Replica) -> None:
        replica.on_dispatch(request.adapter)
        i = self._index[replica.url]
        self.outcomes[request.request_id].replica = i
        if self.tracer is not None:
            step, now = self._steps[i], self.clock.now
            step_end_s = now if step is None else self._step_ends_s[i]
            self.tracer.on_dispatch(request.request_id, request.prompt, i, now, step, step_end_s)
        params: SamplingParams | PoolingParams = (
            PoolingParams()
            if self.is_pooling
            else SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        )
        lora = None if request.adapter is None else self._loras[request.adapter]
        engine = self.engines[i]
        engine.insert_request(engine.make_request(request.request_id, request.prompt, params, lora=lora))
        if self._steps[i] is None:
            self._start_step(i)

    def _start_step(self, i: int) -> None:
        step = self.engines[i].begin_step()
        self._steps[i] = step
        if step is not None:
            self._step_ends_s[i] = self.clock.now + step.duration_s
            self._at(self._step_ends_s[i], "step", i)
            if self.tracer is not None:
                self.tracer.on_step(i, step, self.clock.now)

    def _step_done(self, i: int) -> int:
        step = self._steps[i]
        assert step is not None
        now = self.clock.now
        num_finished = 0
        if any(s.samples for s in step.scheduled.scheduled):
            # Every stream that got a token gets a chunk now: one call stands for them all.
            self._replicas[self.urls[i]].step_phase.on_chunk(now)
        for out in self.engines[i].finish_step(step):
            outcome = self.outcomes[out.request_id]
            if outcome.first_token_s is None:
                outcome.first_token_s = now
                self._replicas[self.urls[i]].on_first_byte()
                if self.tracer is not None:
                    self.tracer.on_first_token(i, out.request_id)
                self._observe(i)  # a streamed response's load headers
            if out.finished:
                outcome.finish_s = now
                self._replicas[self.urls[i]].on_done(outcome.adapter)
                num_finished += 1
                if self.on_finish is not None:
                    self.on_finish(outcome)
        self._start_step(i)
        if num_finished:
            self._pump()
        return num_finished

    def _observe(self, i: int) -> EngineStats:
        stats = self.engines[i].stats()
        sample = LoadSample(stats.num_running, stats.num_waiting, stats.kv_usage_ratio, self.clock.now)
        self.registry.observe(self.urls[i], sample)
        return stats

    def _poll(self, i: int) -> None:
        stats = self._observe(i)
        if self.lora is not None:  # a poll of /metrics reads its lora_requests_info too
            running, waiting = stats.running_lora_adapters, stats.waiting_lora_adapters
            self._replicas[self.urls[i]].lora = LoraState(_names(running), _names(waiting), stats.max_loras)
        if self.tracer is not None:
            self.tracer.on_poll(i)
        self._pump()
        self._at(self.clock.now + self.gateway.poll_interval_s, "poll", i)


def _names(joined: str) -> frozenset[str]:
    return frozenset(n for n in joined.split(",") if n)
