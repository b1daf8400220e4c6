"""Scheduler behaviour on a simulated model (pure: no torch), including randomized invariants."""

from __future__ import annotations

import random

import pytest
from corral_engine.core.block_manager import BlockManager
from corral_engine.core.scheduler import Scheduler, SchedulerConfig
from corral_engine.core.sequence import Request, Sequence, SequenceStatus
from corral_engine.lora import LoraRequest
from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams


class Sim:
    """Drives the scheduler as the engine does, with 'sampled' tokens from a seeded RNG."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: str,
        max_seqs: int = 8,
        budget: int = 32,
        prefix_caching: bool = True,
        max_loras: int = 0,
        max_lora_skip_steps: int = 64,
    ):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        config = SchedulerConfig(max_seqs, budget, policy, max_loras, max_lora_skip_steps)  # type: ignore[arg-type]
        self.sched = Scheduler(config, self.bm)
        self.rng = random.Random(0)
        self.requests: dict[str, Request] = {}
        self.num_ids = 0

    def add(self, prompt: list[int], max_tokens: int, n: int = 1, lora: str | None = None) -> Request:
        rid = f"r{len(self.requests)}"
        params = SamplingParams(max_tokens=max_tokens, n=n)
        request = Request(rid, prompt, params, len(self.requests), RequestMetrics(0), lora=_lora(lora))
        for i in range(n):
            request.seqs.append(Sequence(self.num_ids, request, i, list(prompt), len(prompt)))
            self.num_ids += 1
        self.requests[rid] = request
        self.sched.add(request)
        return request

    def live(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if not s.is_finished]

    def step(self) -> int:
        out = self.sched.schedule()
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            s.seq.num_computed_tokens += s.num_new_tokens
            self.bm.register_computed(s.seq)
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert self.sched.num_running <= self.sched.config.max_num_seqs
        for s in out.scheduled:
            if not s.samples:
                continue
            seq = s.seq
            if seq.index == 0 and seq.request.pending_forks:
                self.sched.fork_siblings(seq.request)
            seq.token_ids.append(self.rng.randrange(1000))
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                seq.finish_reason = "length"
                self.sched.finish(seq)
        self.bm.check_invariants(self.live())
        return len(out.scheduled)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


def _lora(name: str | None) -> LoraRequest | None:
    """An adapter named by one letter ("A" has id 65), or the base model for None."""
    return None if name is None else LoraRequest(name, ord(name), f"/adapters/{name}")


def test_decodes_run_before_new_prompts_and_prompts_are_chunked() -> None:
    sim = Sim(64, 4, "preempt", budget=8)
    a = sim.add(list(range(6)), 4)
    sim.step()  # a's prompt (6 tokens) fits the budget of 8
    b = sim.add(list(range(20)), 4)
    out = sim.sched.schedule()
    assert out.scheduled[0].seq is a.seqs[0] and out.scheduled[0].num_new_tokens == 1
    assert out.scheduled[1].seq is b.seqs[0] and out.scheduled[1].num_new_tokens == 7  # a chunk


def test_preempt_policy_completes_everything_under_a_small_pool() -> None:
    sim = Sim(10, 4, "preempt")
    for i in range(12):
        sim.add([i] * 9, 8)
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert all(r.is_finished for r in sim.requests.values())
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_reserve_policy_never_preempts() -> None:
    sim = Sim(10, 4, "reserve")
    for i in range(12):
        sim.add([i] * 9, 8)
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert all(r.is_finished for r in sim.requests.values())


def test_n_siblings_share_prompt_blocks() -> None:
    sim = Sim(64, 4, "preempt")
    request = sim.add(list(range(13)), 5, n=3)
    sim.step()
    sim.step()
    first = request.seqs[0].block_table[:3]
    for sibling in request.seqs[1:]:
        assert sibling.block_table[:3] == first
    assert sim.bm.blocks[first[0]].ref_count == 3
    sim.run()
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_abort_frees_blocks_of_running_and_waiting() -> None:
    sim = Sim(16, 4, "preempt", max_seqs=1)
    a = sim.add(list(range(10)), 50)
    b = sim.add(list(range(10)), 50, n=2)
    sim.step()
    sim.sched.abort(a)
    sim.sched.abort(b)
    assert not sim.sched.has_unfinished()
    assert sim.bm.num_free_blocks == 16
    sim.bm.check_invariants([])


@pytest.mark.parametrize("policy", ["preempt", "reserve"])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_workload_keeps_invariants(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    sim = Sim(
        rng.randint(12, 40),
        rng.choice([2, 4, 8]),
        policy,
        max_seqs=rng.randint(1, 8),
        budget=rng.randint(4, 64),
    )
    shared = [rng.randrange(1000) for _ in range(24)]
    aborted = 0
    for step in range(400):
        if step < 150 and rng.random() < 0.4:
            prompt = (shared[: rng.randint(0, 24)] if rng.random() < 0.5 else []) + [
                rng.randrange(1000) for _ in range(rng.randint(1, 20))
            ]
            sim.add(prompt, rng.randint(1, 12), n=rng.choice([1, 1, 2, 3]))
        if rng.random() < 0.05 and sim.requests:
            victim = rng.choice(list(sim.requests.values()))
            if not victim.is_finished:
                sim.sched.abort(victim)
                aborted += 1
        sim.step()
    sim.run()
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    sim.bm.check_invariants([])
    if policy == "reserve":
        assert sim.sched.num_preemptions == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("policy", ["preempt", "reserve"])
@pytest.mark.parametrize("seed", range(8))
def test_requests_that_each_fit_the_cache_always_finish(policy: str, prefix_caching: bool, seed: int) -> None:
    """Forked siblings (n > 1) wait holding their parent's prompt blocks; with the parent preempted
    or finished, those blocks must not starve the one sequence that could run (it looped, admitted
    and preempted, or waited, for ever)."""
    rng = random.Random(seed)
    num_blocks, block_size = rng.randint(8, 16), 4
    sim = Sim(num_blocks, block_size, policy, budget=rng.choice([8, 32, 1024]), prefix_caching=prefix_caching)
    capacity = num_blocks * block_size
    for _ in range(rng.randint(2, 6)):
        num_prompt = rng.randint(1, capacity - 1)
        prompt = [rng.randrange(1000) for _ in range(num_prompt)]
        sim.add(prompt, rng.randint(1, capacity - num_prompt), n=rng.choice([1, 2, 3]))
    sim.run(max_steps=2_000)
    assert all(r.is_finished for r in sim.requests.values())
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def _running_loras(sim: Sim) -> set[str]:
    return {s.request.lora.name for s in sim.sched.running if s.request.lora is not None}


def test_a_request_without_an_adapter_slot_lets_those_needing_none_pass() -> None:
    """max_loras 1 with A running: B's request keeps its place at the head while a base request
    and A's next one run; the metric still counts B as waiting."""
    sim = Sim(64, 4, "preempt", max_loras=1)
    sim.add([1, 2, 3], 50, lora="A")
    sim.step()
    b = sim.add([4, 5, 6], 4, lora="B")
    base = sim.add([7, 8, 9], 4)
    a2 = sim.add([10, 11, 12], 4, lora="A")
    out = sim.sched.schedule()
    admitted = [s.seq for s in out.scheduled[1:]]
    assert admitted == [base.seqs[0], a2.seqs[0]]
    assert list(sim.sched.waiting) == [b.seqs[0]]
    assert sim.sched.lora_names() == ("A", "B")


def test_one_short_of_blocks_still_stops_admission_behind_a_skipped_one() -> None:
    """FCFS for everything but adapter slots: A's request passes B's, the next (too big for the
    free blocks) stops admission, so the small one behind it waits too."""
    sim = Sim(6, 4, "preempt", max_loras=1)
    sim.add([1, 2, 3], 20, lora="A")
    sim.step()
    b = sim.add([4, 5, 6], 4, lora="B")
    a2 = sim.add([7, 8], 4, lora="A")
    big = sim.add(list(range(30)), 4)
    small = sim.add([9], 4)
    out = sim.sched.schedule()
    assert [s.seq for s in out.scheduled[1:]] == [a2.seqs[0]]
    assert list(sim.sched.waiting) == [b.seqs[0], big.seqs[0], small.seqs[0]]


def test_a_skipped_adapter_is_not_starved_by_a_running_adapters_stream() -> None:
    """A's requests keep arriving: they pass B's for max_lora_skip_steps steps, then queue behind
    it so A drains and B runs; base requests pass it all along (they hold no slot)."""
    bound = 3
    sim = Sim(256, 4, "preempt", max_seqs=64, budget=256, max_loras=1, max_lora_skip_steps=bound)
    sim.add([1, 2], 6, lora="A")
    sim.step()
    b = sim.add([3, 4], 2, lora="B")
    passed_at: dict[str | None, list[int]] = {"A": [], None: []}  # steps its new request ran in
    for step in range(1, 40):
        new = [sim.add([step, 5], 6, lora="A"), sim.add([step, 6], 1)]
        sim.step()
        for request in new:
            if request.seqs[0].status is not SequenceStatus.WAITING:
                passed_at[request.lora.name if request.lora else None].append(step)
        if b.seqs[0].status is not SequenceStatus.WAITING:
            break
        assert _running_loras(sim) <= {"A"}
    else:
        raise AssertionError("B's request never ran")
    assert passed_at["A"] == list(range(1, bound + 1))  # A passes B only until the bound
    assert passed_at[None] == list(range(1, step + 1))  # base requests pass all along
    assert _running_loras(sim) == {"B"}


@pytest.mark.parametrize("seed", range(6))
def test_randomized_adapter_traffic_keeps_max_loras_and_finishes(seed: int) -> None:
    rng = random.Random(seed)
    max_loras = rng.randint(1, 2)
    sim = Sim(
        rng.randint(16, 40),
        4,
        rng.choice(["preempt", "reserve"]),
        max_seqs=rng.randint(2, 8),
        budget=rng.randint(8, 64),
        max_loras=max_loras,
        max_lora_skip_steps=rng.randint(0, 8),
    )
    for step in range(300):
        if step < 150 and rng.random() < 0.5:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
            lora = rng.choice([None, "A", "B", "C"])
            sim.add(prompt, rng.randint(1, 10), n=rng.choice([1, 1, 2]), lora=lora)
        sim.step()
        assert len(_running_loras(sim)) <= max_loras
    sim.run()
    assert all(r.is_finished for r in sim.requests.values())
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_whole_prompts_wait_for_a_step_with_room_instead_of_being_chunked() -> None:
    """An encoder's prompts (can_chunk_prompts=False) run whole: one that does not fit what is left
    of the step's budget waits for the next step, and the queue behind it waits too (FCFS)."""
    bm = BlockManager(64, 4, False)
    sched = Scheduler(SchedulerConfig(8, 10, can_chunk_prompts=False), bm)
    requests = []
    for i, n in enumerate((6, 7, 2)):
        request = Request(f"r{i}", list(range(n)), SamplingParams(max_tokens=1), i, RequestMetrics(0))
        request.seqs.append(Sequence(i, request, 0, list(range(n)), n))
        sched.add(request)
        requests.append(request)
    first = sched.schedule()
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in first.scheduled] == [(0, 0, 6)]
    for s in first.scheduled:  # done, as a pooled request is once its prompt is in
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.finish_reason = "stop"
        sched.finish(s.seq)
    second = sched.schedule()
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in second.scheduled] == [(1, 0, 7), (2, 0, 2)]
