"""What the engine hands back: per-request outputs and an engine-wide stats snapshot (no torch)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from corral_engine.core.block_manager import BlockManager
    from corral_engine.core.scheduler import Scheduler

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives as (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier (None where not computed)


@dataclass(slots=True)
class CompletionOutput:
    """One of the request's n sequences. `delta_*` is what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    delta_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps in seconds (time.monotonic) and per-request counts.

    With n > 1, `children` holds each sequence's own, in index order: vLLM v1 fans such a request
    out into a child request per sequence, each timed and counted in the metrics as a request, and
    so do the metrics here. A child's token times and end are its own; its arrival, queue wait and
    first scheduling are the request's (the sequences share one prefill). The request's own token
    times span its sequences' (the first token of any, the last of any)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    children: list[RequestMetrics] | None = None

    @classmethod
    def for_sequences(cls, arrival_time: float, num_seqs: int) -> RequestMetrics:
        """A new request's metrics, with a child per sequence where it has several."""
        if num_seqs == 1:
            return cls(arrival_time)
        return cls(arrival_time, children=[cls(arrival_time) for _ in range(num_seqs)])

    def child(self, index: int) -> RequestMetrics:
        """Sequence `index`'s metrics: its child's, or the request's own where it has one sequence."""
        return self if self.children is None else self.children[index]

    def finish(self, now: float) -> None:
        """Stamp the request's end. Its children that have not ended (aborted, or the last to
        finish) end now too, and all take its first scheduling: their shared prefill's."""
        self.finished_time = now
        for child in self.children or ():
            child.first_scheduled_time = self.first_scheduled_time
            if child.finished_time is None:
                child.finished_time = now


@dataclass(slots=True)
class StepLatencies:
    """What one engine step adds to the token-latency histograms (`vllm:time_to_first_token_seconds`
    and `vllm:inter_token_latency_seconds`), taken where the tokens are made, as vLLM's engine core
    reports them: however often outputs reach the server (`--stream-interval`, final-only
    requests, steps merged while the event loop was behind), every token counts at its own step."""

    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    def tokens_made(self, metrics: RequestMetrics, now: float, num_tokens: int, index: int = 0) -> bool:
        """Stamp a request's metrics with sequence `index`'s `num_tokens` new tokens made at `now`
        (called once per sequence that gained any) and keep the latencies they add: the time to
        the sequence's first token, or the gap since its last ones, split evenly over the tokens
        made together (accepted drafts). Each of a request's n sequences counts as a request of its
        own (`RequestMetrics.children`). True for the sequence's first tokens."""
        if metrics.children is not None:  # the request's span, then the child's own times
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics = metrics.children[index]
        last = metrics.last_token_time
        metrics.last_token_time = now
        if last is None:
            metrics.first_token_time = now
            self.ttft_s.append(max(0.0, now - metrics.arrival_time))
            return True
        if now != last and num_tokens > 0:
            gap_s = max(0.0, now - last) / num_tokens
            if num_tokens == 1:
                self.itl_s.append(gap_s)
            else:
                self.itl_s.extend([gap_s] * num_tokens)
        return False


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # prompt_logprobs: None for the first prompt token, then one per token (as far as computed).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's vector, on its one (final) output; `outputs` is then empty.
    embedding: list[float] | None = None


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's load and cumulative counters."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_blocks: int = 0  # includes cached blocks nothing references (reclaimable)
    num_cached_blocks: int = 0
    block_size: int = 16
    cache_dtype: str = "auto"  # --kv-cache-dtype, as vLLM's cache_config_info labels it
    kv_usage_ratio: float = 0.0  # used / total, reclaimable cached blocks count as free
    num_preemptions_total: int = 0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_prefix_cache_queries_total: int = 0  # tokens looked up
    num_prefix_cache_hits_total: int = 0  # tokens found
    num_steps_total: int = 0
    num_spec_proposed_total: int = 0  # speculative draft tokens verified
    num_spec_accepted_total: int = 0  # ... and accepted
    num_spec_drafts_total: int = 0  # sequences' drafts verified (one a sequence a step)
    # Per draft position: the drafts whose token there was accepted (so were all before it). One
    # entry per speculative token with --speculative, none without.
    num_spec_accepted_per_pos: list[int] = field(default_factory=list)
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Requests the step loop has taken from its front (into the scheduler, refused, or aborted
    # before it took them in) when this snapshot was made: set by the loop, not the engine.
    num_requests_taken_total: int = 0
    # LoRA (vllm:lora_requests_info): slots a step has (0: LoRA off), the running and waiting
    # requests' adapters (comma-separated names), and the Unix time either last changed.
    max_loras: int = 0
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""
    lora_changed_time_s: float = 0.0

    def observe(self, scheduler: Scheduler, block_manager: BlockManager) -> EngineStats:
        """Refresh the load fields from the scheduler and block manager, and return a snapshot the
        caller may hand to another thread (the counters go on accumulating here)."""
        bm = block_manager
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting
        self.num_free_blocks = bm.num_free_blocks
        self.num_cached_blocks = bm.num_cached_free_blocks
        self.kv_usage_ratio = bm.usage_ratio
        self.num_preemptions_total = scheduler.num_preemptions
        self.num_prefix_cache_queries_total = bm.num_prefix_queries
        self.num_prefix_cache_hits_total = bm.num_prefix_hits
        if self.max_loras:
            names = scheduler.lora_names()
            known = (self.running_lora_adapters, self.waiting_lora_adapters)
            if names != known or not self.lora_changed_time_s:
                self.running_lora_adapters, self.waiting_lora_adapters = names
                self.lora_changed_time_s = time.time()
        snapshot = dataclasses.replace(self)
        snapshot.finished_by_reason = dict(self.finished_by_reason)
        snapshot.num_spec_accepted_per_pos = list(self.num_spec_accepted_per_pos)
        return snapshot


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output saying what `earlier` then `later` said: `later`'s state with both deltas
    joined. A consumer that falls behind the engine takes its queued outputs as one (one SSE event
    and one socket write for several tokens) instead of paying per token while behind; so does an
    event loop that falls behind the steps (`StreamFront._take_posted`)."""
    earlier_by_index = {o.index: o for o in earlier.outputs}
    merged = []
    for o in later.outputs:
        e = earlier_by_index.get(o.index)
        if e is None:
            merged.append(o)
            continue
        logprobs = None
        if e.delta_logprobs is not None or o.delta_logprobs is not None:
            logprobs = (e.delta_logprobs or []) + (o.delta_logprobs or [])
        merged.append(
            CompletionOutput(
                index=o.index,
                text=o.text,
                token_ids=o.token_ids,
                delta_text=e.delta_text + o.delta_text,
                delta_token_ids=e.delta_token_ids + o.delta_token_ids,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
                delta_logprobs=logprobs,
            )
        )
    return RequestOutput(
        later.request_id,
        later.prompt_token_ids,
        merged,
        later.finished,
        later.metrics,
        later.prompt_logprobs,
        later.embedding,
    )
