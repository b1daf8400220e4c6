"""Sequences and requests as the scheduler sees them: token ids, progress, blocks, status.

The one rule (after vLLM v1): a sequence knows how many of its tokens have KV computed
(`num_computed_tokens`); each step computes some of the rest. That covers chunked prefill,
prefix-cache hits and resume-after-preemption alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from corral_engine.lora import LoraRequest
from corral_engine.outputs import FinishReason, RequestMetrics, TokenLogprob
from corral_engine.pooling_params import PoolingParams
from corral_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from corral_engine.multimodal import ImageInput


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: Request
    index: int  # which of the request's n completions this is
    token_ids: list[int]  # prompt followed by output tokens
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained prefix hashes of this sequence's full blocks, in order (kept across preemption).
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already published to the prefix cache
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # Steps it has waited at its turn for a LoRA adapter slot since it last ran (the scheduler's
    # starvation guard reads it).
    num_lora_skips: int = 0
    # Draft tokens proposed for the next step (speculative decoding); verified, never trusted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Filled by the engine's output side (detokenizer); the core never reads them.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Structured outputs: the grammar state (an llguidance matcher) after the last output token.
    # It lives with the tokens, so preemption (which recomputes only KV) leaves it valid.
    grammar: Any = None
    # prompt_logprobs: one per prompt token after the first, filled as prefill chunks are computed.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence can reach: prompt + max_tokens (what `reserve` admits against)."""
        return self.num_prompt_tokens + self.request.params.max_output_tokens


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    lora: LoraRequest | None = None  # the adapter it generates with; None: the base model
    # An embedding request (--runner pooling): its prompt is computed, pooled and the request ends;
    # `params` is then a fixed one-token SamplingParams the scheduler admits it by.
    pooling: PoolingParams | None = None
    # A vision-language prompt's images, by placeholder offset (the runner embeds them; the block
    # manager keys blocks that overlap one by its content hash too).
    mm_inputs: tuple[ImageInput, ...] = ()
    # n > 1: siblings wait here until the first sequence has computed its prompt, then fork
    # from it and share its full prompt blocks.
    pending_forks: list[Sequence] = field(default_factory=list)
    # The output side's stream interval: the sequences whose first tokens went out, and the tokens
    # per sequence (seq_id -> count) gained since the last output, held back for the next.
    started_seq_ids: set[int] | None = None
    held_counts: dict[int, int] | None = None

    @property
    def is_finished(self) -> bool:
        if self.pending_forks:
            return False
        for seq in self.seqs:  # noqa: SIM110 (a loop, not all(generator): runs per request per step)
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True
