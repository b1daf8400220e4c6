"""The replica registry: which replicas serve which model, their live load and health (pure, no I/O).

Load combines the last sample (from /metrics polls or response headers) with the gateway's own
in-flight and recently dispatched counts; a sample older than `max_age_s` is not trusted.

Health, as in Envoy's outlier detection: `eject_after_failures` failures in a row make a replica
failing, and take it out of rotation unless it is its model's last one there (then the ejection is
withheld: requests still try it, but it counts as failing). A request it answers, or for a failing
replica left in rotation a healthy poll, clears that; an ejected one comes back through a probe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from corral_gateway.load import LoadSample, LoraState
from corral_gateway.refusal import Refusal
from corral_gateway.step_phase import StepPhase


@dataclass(frozen=True, slots=True)
class Saturation:
    max_waiting: int = 5
    max_kv_usage_ratio: float = 0.8


@dataclass(slots=True)
class Replica:
    model: str
    url: str
    sample: LoadSample | None = None
    num_inflight: int = 0  # requests this gateway is proxying to the replica now
    num_dispatched_since_sample: int = 0  # sent after the last sample was taken, so not in it
    num_finished_since_sample: int = 0  # finished after the last sample, so still counted in it
    num_first_bytes: int = 0  # responses whose first bytes came back: their prompts are computed
    refusal: Refusal = field(default_factory=Refusal)  # since it last said its own queue is full
    step_phase: StepPhase = field(default_factory=StepPhase)  # fed with its streams' chunk times
    num_consecutive_failures: int = 0
    # The failure threshold was reached (ejected or not); cleared by a success or a re-admission.
    is_failing: bool = False
    num_ejections: int = 0  # in a row; ejection time doubles with each
    ejected_until_s: float | None = None
    last_score: float = 0.0
    # The model names the replica says it serves (its /v1/models); None until it has said.
    served_names: tuple[str, ...] | None = None
    # Its /v1/models entry for the name it is routed under (max_model_len, created, owned_by).
    model_card: dict[str, Any] | None = None
    # The LoRA adapters of its base model it lists (name -> the entry's fields a listing passes on).
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    lora: LoraState | None = None  # its running / waiting adapters, as it last reported them
    # Adapter requests this gateway is proxying to it now, by adapter: they hold the adapter
    # there whatever the last report said.
    num_inflight_by_adapter: dict[str, int] = field(default_factory=dict)
    # The last `load` and what it was computed from: every request ranks every replica, and between
    # two requests most replicas' inputs have not changed (64 replicas: 6% of the gateway's CPU).
    _load_inputs: tuple[object, ...] = field(default=(), repr=False, compare=False)
    _load: ReplicaLoad | None = field(default=None, repr=False, compare=False)

    @property
    def is_ejected(self) -> bool:
        return self.ejected_until_s is not None

    @property
    def is_answering(self) -> bool:
        """Neither ejected nor failing: the gateway's own observation of it (names aside)."""
        return not self.is_ejected and not self.is_failing

    def observe(self, sample: LoadSample) -> None:
        if self.sample is None or sample.at_s >= self.sample.at_s:
            self.sample = sample
            self.num_dispatched_since_sample = 0
            self.num_finished_since_sample = 0
            self.refusal.on_sample(sample)

    def on_dispatch(self, adapter: str | None = None) -> None:
        self.num_inflight += 1
        self.num_dispatched_since_sample += 1
        self.refusal.on_dispatch()
        if adapter is not None:
            self.num_inflight_by_adapter[adapter] = self.num_inflight_by_adapter.get(adapter, 0) + 1

    def on_first_byte(self) -> None:
        self.num_first_bytes += 1

    def on_done(self, adapter: str | None = None) -> None:
        self.num_inflight = max(0, self.num_inflight - 1)
        self.num_finished_since_sample += 1
        self.refusal.on_done()
        if adapter is not None:
            left = self.num_inflight_by_adapter.pop(adapter, 0) - 1
            if left > 0:
                self.num_inflight_by_adapter[adapter] = left

    def active_adapters(self) -> frozenset[str]:
        """The adapters it runs or queues now: as last reported, and those of the adapter requests
        this gateway has in flight there."""
        reported = self.lora.active if self.lora is not None else frozenset()
        return reported | self.num_inflight_by_adapter.keys()

    def load(self, now_s: float, max_age_s: float) -> ReplicaLoad:
        """The last fresh sample, moved forward by what this gateway sent and saw finish since."""
        sample = self.sample
        is_fresh = sample is not None and now_s - sample.at_s <= max_age_s
        is_refusing = self.refusal.is_refusing(now_s, self.num_inflight)
        inputs = (  # the sample itself, not its id: a freed sample's id may come back
            sample,
            is_fresh,
            is_refusing,
            self.num_inflight,
            self.num_dispatched_since_sample,
            self.num_finished_since_sample,
        )
        if self._load is None or inputs != self._load_inputs:
            self._load, self._load_inputs = self._compute_load(is_fresh, is_refusing), inputs
        return self._load

    def describe(
        self, now_s: float, load: ReplicaLoad, *, is_healthy: bool, serves_model: bool | None
    ) -> dict[str, object]:
        """Its state for the /corral/replicas debug endpoint (`serves_model`: its /v1/models lists
        the name its requests carry; None: not known)."""
        return {
            "url": self.url,
            "healthy": is_healthy,
            "ejected": self.is_ejected,
            "num_consecutive_failures": self.num_consecutive_failures,
            "served_names": list(self.served_names) if self.served_names is not None else None,
            "serves_model": serves_model,
            # Its LoRA adapters, and those it runs or queues (reported or in flight).
            "adapters": sorted(self.adapters),
            "active_adapters": sorted(self.active_adapters()),
            "max_lora": self.lora.max_lora if self.lora is not None else None,
            "load_fresh": load.is_fresh,
            "num_running": load.num_running,
            "num_waiting": load.num_waiting,
            "kv_usage_ratio": load.kv_usage_ratio,
            "num_inflight": self.num_inflight,
            "num_first_bytes": self.num_first_bytes,
            # From its streams' chunk times; None until seen, or when quiet.
            "step_interval_s": self.step_phase.step_s or None,
            "step_time_left_s": self.step_phase.time_left_s(now_s),
            "score": self.last_score,
        }

    def _compute_load(self, is_fresh: bool, is_refusing: bool) -> ReplicaLoad:
        sample = self.sample
        if sample is None or not is_fresh:
            inflight = float(self.num_inflight)
            return ReplicaLoad(False, inflight, 0.0, 0.0, self.num_inflight, 0.0, 0.0, is_refusing)
        kv_per_request = sample.kv_usage_ratio / sample.num_running if sample.num_running >= 1 else 0.0
        # What the engine reported, less what finished since (finished requests free slots and KV).
        num_finished = self.num_finished_since_sample
        moved = min(sample.num_waiting, num_finished)
        waiting_reported = sample.num_waiting - moved
        kv_reported = max(0.0, sample.kv_usage_ratio - num_finished * kv_per_request)
        running = max(0.0, sample.num_running - num_finished + moved)
        # For ranking replicas, also count what was sent since: an engine that still queues will
        # queue it, otherwise it likely runs it; each takes about the average KV of a running request.
        num_sent = self.num_dispatched_since_sample
        waiting = waiting_reported
        if waiting > 0:
            waiting += num_sent
        else:
            running += num_sent
        kv = min(1.0, max(0.0, kv_reported + num_sent * kv_per_request))
        return ReplicaLoad(
            True, running, waiting, kv, self.num_inflight, waiting_reported, kv_reported, is_refusing
        )


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    is_fresh: bool
    num_running: float  # estimates including requests sent since the sample: for ranking
    num_waiting: float
    kv_usage_ratio: float
    num_inflight: int
    # As reported (less finished requests): for saturation. Requests sent since the last sample do
    # not count, so a burst cannot make the gateway hold requests an engine would have run at once;
    # herding is bounded by the poll interval and refreshed by every response's load headers.
    num_waiting_reported: float
    kv_usage_ratio_reported: float
    # It refused a request for its own queue being full (429) and has not made room since: an
    # engine's `--max-waiting` may be below any threshold of `Saturation`.
    is_refusing: bool = False

    def is_saturated(self, saturation: Saturation) -> bool:
        # Stale data says nothing about saturation; the gateway falls back to its in-flight counts.
        return self.is_refusing or (
            self.is_fresh
            and (
                self.num_waiting_reported > saturation.max_waiting
                or self.kv_usage_ratio_reported > saturation.max_kv_usage_ratio
            )
        )

    def is_full(self, saturation: Saturation) -> bool:
        """Saturated once what was sent since the sample is counted too. Requests leaving the
        gateway's queue use this: they waited because the fleet was saturated, so each freed slot
        takes one of them, instead of the whole queue rushing to the first replica that dips below
        a threshold."""
        return self.is_saturated(saturation) or (
            self.is_fresh
            and (
                self.num_waiting > saturation.max_waiting
                or self.kv_usage_ratio > saturation.max_kv_usage_ratio
            )
        )

    @property
    def num_outstanding(self) -> float:
        return self.num_running + self.num_waiting if self.is_fresh else float(self.num_inflight)


@dataclass(slots=True)
class Ejection:
    after_failures: int = 3
    base_s: float = 2.0
    max_s: float = 30.0


@dataclass(slots=True)
class Registry:
    ejection: Ejection = field(default_factory=Ejection)
    _by_model: dict[str, dict[str, Replica]] = field(default_factory=dict)
    # url -> its replicas (one per model it serves), rebuilt when the replica sets change: every
    # response's load headers and success look a replica up by URL, which a scan of the whole
    # fleet made O(replicas) per request.
    _by_url: dict[str, list[Replica]] = field(default_factory=dict)
    # Called with each replica that leaves (the policies' per-replica state goes with it).
    on_removed: list[Callable[[Replica], None]] = field(default_factory=list)

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def has_model(self, model: str) -> bool:
        return model in self._by_model

    def replicas(self, model: str) -> list[Replica]:
        return list(self._by_model.get(model, {}).values())

    def all_replicas(self) -> list[Replica]:
        return [r for reps in self._by_model.values() for r in reps.values()]

    def urls(self) -> set[str]:
        return {r.url for r in self.all_replicas()}

    def by_url(self, url: str) -> list[Replica]:
        return self._by_url.get(url, [])

    def _index_urls(self) -> None:
        self._by_url = {}
        for replica in self.all_replicas():
            self._by_url.setdefault(replica.url, []).append(replica)

    def candidates(self, model: str) -> list[Replica]:
        return [r for r in self._by_model.get(model, {}).values() if not r.is_ejected]

    def set_replicas(self, model: str, urls: Iterable[str], keep_model: bool = True) -> None:
        """Make `urls` the model's replica set, keeping the state of replicas already known."""
        current = self._by_model.get(model, {})
        wanted = list(dict.fromkeys(urls))
        updated = {url: current.get(url) or Replica(model=model, url=url) for url in wanted}
        if updated or keep_model:
            self._by_model[model] = updated
        else:
            self._by_model.pop(model, None)
        self._index_urls()
        self._removed([r for url, r in current.items() if url not in updated])

    def remove_model(self, model: str) -> None:
        gone = self._by_model.pop(model, {})
        self._index_urls()
        self._removed(list(gone.values()))

    def _removed(self, replicas: list[Replica]) -> None:
        for replica in replicas:
            for hook in self.on_removed:
                hook(replica)

    def observe(self, url: str, sample: LoadSample) -> None:
        for replica in self.by_url(url):
            replica.observe(sample)

    def record_success(self, url: str) -> None:
        for replica in self.by_url(url):
            replica.num_consecutive_failures = 0
            replica.is_failing = False

    def record_failure(self, url: str, now_s: float) -> bool:
        """Count a failure; returns True when this failure ejects the replica. At the threshold it
        is failing, ejected or not (a model's last replica in rotation stays there)."""
        ejected_now = False
        for replica in self.by_url(url):
            replica.num_consecutive_failures += 1
            if replica.num_consecutive_failures >= self.ejection.after_failures:
                replica.is_failing = True
            if replica.is_ejected or not replica.is_failing:
                continue
            # Never eject a model's last replica in rotation: failing fast beats queueing for nothing.
            if not any(r is not replica for r in self.candidates(replica.model)):
                continue
            duration_s = min(self.ejection.max_s, self.ejection.base_s * 2**replica.num_ejections)
            replica.ejected_until_s = now_s + duration_s
            replica.num_ejections += 1
            replica.sample = None
            ejected_now = True
        return ejected_now

    def poll_succeeded(self, url: str) -> list[Replica]:
        """A healthy load poll: failing replicas left in rotation are well again (a request they
        answer would say the same). Below the threshold the streak stands, so a replica that
        answers polls but fails requests is still ejected. Returns the replicas it cleared."""
        recovered = [r for r in self.by_url(url) if r.is_failing and not r.is_ejected]
        for replica in recovered:
            replica.num_consecutive_failures = 0
            replica.is_failing = False
        return recovered

    def is_due_for_probe(self, url: str, now_s: float) -> bool:
        return any(r.ejected_until_s is not None and now_s >= r.ejected_until_s for r in self.by_url(url))

    def probe_failed(self, url: str, now_s: float) -> None:
        for replica in self.by_url(url):
            if replica.is_ejected:
                duration_s = min(self.ejection.max_s, self.ejection.base_s * 2**replica.num_ejections)
                replica.ejected_until_s = now_s + duration_s
                replica.num_ejections += 1

    def readmit(self, url: str) -> bool:
        """A healthy probe: back into rotation. Returns True if it was ejected."""
        was_ejected = False
        for replica in self.by_url(url):
            was_ejected = was_ejected or replica.is_ejected
            replica.ejected_until_s = None
            replica.num_ejections = 0
            replica.num_consecutive_failures = 0
            replica.is_failing = False
        return was_ejected
