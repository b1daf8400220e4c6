"""Iteration-level scheduler: each step spends a token budget on running sequences, then waiting ones.

Running sequences go first (decodes and unfinished prompt chunks, oldest first), then waiting ones
FCFS, the last admitted possibly as a chunk (chunked prefill). Under `preempt`, a step that runs out
of blocks preempts the newest running sequence (its KV is recomputed later); under `reserve`, a
sequence is admitted only with blocks for prompt + max_tokens, so nothing is ever preempted.
With LoRA, the running sequences use at most `max_loras` distinct adapters: a waiting one whose
adapter would be one too many is skipped, keeping its place, and those behind it that need no new
adapter slot may go (as vLLM does); once it has waited `max_lora_skip_steps` steps, the running
adapters' requests stop overtaking it, so those adapters drain and it gets a slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from corral_engine.core.block_manager import BlockManager
from corral_engine.core.sequence import Request, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_policy: Literal["preempt", "reserve"] = "preempt"
    max_loras: int = 0  # distinct LoRA adapters among the running sequences; 0: LoRA is off
    # Steps a request may wait at its turn for an adapter slot while running adapters' requests
    # overtake it; after that they queue behind it. 64 decode steps (a second or two on a GPU) let
    # a running adapter's burst join its batch yet add little beside the drain it waits for anyway.
    max_lora_skip_steps: int = 64
    # False: a prompt is admitted only whole, in one step (an encoder's bidirectional attention
    # cannot be split); one that does not fit this step's budget waits, and so does the queue behind it.
    can_chunk_prompts: bool = True


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first token position computed this step (== num_computed_tokens before the step)
    num_new_tokens: int  # including num_spec draft tokens
    num_spec: int = 0  # draft tokens appended after the sequence's real tokens, to be verified

    def prompt_positions(self) -> range:
        """prompt_logprobs: the positions of this chunk whose logits score the next prompt token,
        each prompt position once (a recompute after preemption scores nothing again); only the
        first sequence's, since its siblings share its prompt."""
        seq = self.seq
        if seq.request.params.prompt_logprobs is None or seq.index != 0:
            return range(0)
        start = max(self.start, len(seq.prompt_logprobs))
        return range(start, min(self.start + self.num_new_tokens - self.num_spec, seq.num_prompt_tokens - 1))

    def lora_id(self) -> int | None:
        """The adapter this chunk runs with (its LoraRequest's id), None for the base model."""
        lora = self.seq.request.lora
        return None if lora is None else lora.lora_id

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so a new one is sampled."""
        return self.start + self.num_new_tokens - self.num_spec == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        first, *siblings = request.seqs
        request.pending_forks = siblings
        self.waiting.append(first)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            num_spec = self._fit_spec(seq, num_new, budget)
            num_new += num_spec
            while not self.bm.allocate(seq, num_new):
                victim = self.running[-1]  # newest first
                if victim is seq and self._release_waiting_blocks(seq):
                    continue
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, num_spec))
            budget -= num_new
            i += 1
        return budget

    def _fit_spec(self, seq: Sequence, num_new: int, budget: int) -> int:
        """Draft tokens to verify this step: only on a plain decode step, only if the budget and
        free blocks allow (speculation never causes a preemption)."""
        num_spec = len(seq.spec_token_ids)
        if not num_spec:
            return 0
        if num_new != seq.num_uncomputed_tokens or num_new + num_spec > budget:
            seq.spec_token_ids = []
            return 0
        if not self.bm.can_allocate(self.bm.num_blocks_needed(seq, num_new + num_spec)):
            seq.spec_token_ids = []
            return 0
        return num_spec

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        loras = self._running_loras() if self.config.max_loras else set()
        num_skipped = 0  # those passed over this step: always the queue's first ones, in order
        is_guarded = False  # one ahead waited too long for a slot: running adapters' requests wait
        while num_skipped < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[num_skipped]
            lora = seq.request.lora
            if not self._has_lora_room(seq, loras):
                seq.num_lora_skips += 1  # it keeps its place; those behind it needing no slot may go
                is_guarded = is_guarded or seq.num_lora_skips > self.config.max_lora_skip_steps
                num_skipped += 1
                continue
            if is_guarded and lora is not None:
                num_skipped += 1  # a running adapter's (no slot is free): it lets that adapter drain
                continue
            if not self.config.can_chunk_prompts and seq.num_uncomputed_tokens > budget:
                break  # FCFS: the next step's budget takes it whole
            if not self._admit(seq, budget) and not self._admit_after_release(seq, budget):
                break  # FCFS: nothing overtakes one short of blocks
            del self.waiting[num_skipped]
            seq.status = SequenceStatus.RUNNING
            seq.num_lora_skips = 0  # a preempted one waits afresh
            self.running.append(seq)
            if lora is not None:
                loras.add(lora.lora_id)
            num_new = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new

    def _running_loras(self) -> set[int]:
        return {s.request.lora.lora_id for s in self.running if s.request.lora is not None}

    def _has_lora_room(self, seq: Sequence, loras: set[int]) -> bool:
        """Whether `seq` may join the running ones (whose adapters' ids are `loras`) without more
        than max_loras adapters among them."""
        lora = seq.request.lora
        if lora is None or not self.config.max_loras:
            return True
        return lora.lora_id in loras or len(loras) < self.config.max_loras

    def lora_names(self) -> tuple[str, str]:
        """(running, waiting) adapters' names, each comma-separated in first-seen order."""
        running = {s.request.lora.name: None for s in self.running if s.request.lora is not None}
        waiting = {s.request.lora.name: None for s in self.waiting if s.request.lora is not None}
        return ",".join(running), ",".join(waiting)

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Give `seq` its cached prefix and the blocks for what it computes now (or, under
        `reserve`, for everything it may ever need). On failure nothing new is held."""
        had_blocks = bool(seq.block_table)  # a forked sibling already shares its prompt blocks
        matched = seq.num_computed_tokens  # a sibling's shared blocks: its hits, as vLLM counts a child's
        is_scored = seq.request.params.prompt_logprobs is not None  # every token computed: no lookup
        if not had_blocks and not is_scored:
            cached = self.bm.match_prefix(seq)
            self.bm.adopt_prefix(seq, cached)
            matched = len(cached) * self.bm.block_size
        if self.config.kv_policy == "reserve":
            num_new = max(0, seq.max_total_tokens - seq.num_computed_tokens)
        else:
            num_new = min(seq.num_uncomputed_tokens, budget)
        if not self.bm.allocate(seq, num_new):
            if not had_blocks:
                self.bm.free(seq)
            return False
        if seq.num_preemptions == 0 and not is_scored:  # each sequence's prompt once, as prompt_tokens
            self.bm.record_prefix_query(seq.num_tokens, matched)
        if not had_blocks and seq.num_preemptions == 0:
            seq.request.metrics.num_cached_tokens = matched  # a response's usage reports it
        return True

    def _admit_after_release(self, seq: Sequence, budget: int) -> bool:
        """With nothing running, no block is freed unless the waiting let go of theirs."""
        return not self.running and self._release_waiting_blocks(seq) and self._admit(seq, budget)

    def _release_waiting_blocks(self, keep: Sequence) -> bool:
        """Forked siblings (n > 1) wait holding their parent's prompt blocks. Once their parent is
        gone those blocks can starve the one sequence that could run (`keep`: the last running one,
        or the head of the queue with nothing running) for ever, so they let go: each recomputes its
        prompt, or finds it in the prefix cache, when admitted. False if no waiting one held any."""
        released = False
        for seq in self.waiting:
            if seq is not keep and seq.block_table:
                self.bm.free(seq)
                released = True
        return released

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after a step ---------------------------------------------------------------------------
    def fork_siblings(self, request: Request) -> None:
        """Once the first sequence has computed its prompt, siblings share its full prompt blocks
        and queue at the front (they belong to a request that is already running)."""
        parent = request.seqs[0]
        for sibling in reversed(request.pending_forks):
            self.bm.fork(parent, sibling)
            self.waiting.appendleft(sibling)
        request.pending_forks = []

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request: Request) -> None:
        for seq in request.pending_forks:
            seq.finish_reason = "abort"
            seq.status = SequenceStatus.FINISHED
        request.pending_forks = []
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.finish(seq)
