"""The simulated engine's step, without a model: the real scheduler, block manager, prefix cache and
output processor; a step's duration comes from a step-time model and its tokens from the prompt.

A step is split in two so the caller decides how time passes: `begin_step` schedules and says how
long the batch would take on the profile's GPU; `finish_step` commits it (tokens computed, one token
sampled per sequence that reached its end, stop rules, outputs). The asyncio front sleeps between
the two; the fleet benchmark advances a virtual clock instead. An embedding model's replica
(`pooling`) runs prompts only and ends each request, once its prompt is computed, with a
pseudo-vector (`sim/embedding.py`). A vision-language checkpoint's replica (`vision`) takes images as
the engine does and adds its vision tower's time to the steps that embed them (`sim/vision_cost.py`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corral_engine.core.block_manager import BlockManager
from corral_engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from corral_engine.core.sequence import Request, Sequence
from corral_engine.errors import InvalidRequestError
from corral_engine.lora import LoraRequest
from corral_engine.multimodal import ImageInput
from corral_engine.output_processor import OutputProcessor
from corral_engine.outputs import EngineStats, RequestOutput, StepLatencies, TokenLogprob
from corral_engine.pooling import EmbedSpec
from corral_engine.pooling_params import PoolingParams
from corral_engine.request_builder import RequestBuilder
from corral_engine.sampling_params import SamplingParams
from corral_engine.sim.embedding import SimPooling
from corral_engine.sim.grammar import SimGrammars
from corral_engine.sim.logprobs import synthetic_logprob
from corral_engine.sim.lora_cost import LoraCost
from corral_engine.sim.perf_model import Profile, StepShape
from corral_engine.sim.vision import SimVision
from corral_engine.sim.vision_cost import ImageSteps, vision_cost

Prompt = str | list[int]


@dataclass(slots=True)
class SimStep:
    scheduled: SchedulerOutput
    shape: StepShape
    duration_s: float
    vision_s: float = 0.0  # of duration_s: the vision tower's, embedding this step's new images


class SimEngine:
    def __init__(
        self,
        profile: Profile,
        tokenizer: Any,
        served_model_name: str,
        eos_token_ids: tuple[int, ...] = (),
        *,
        enable_prefix_caching: bool = True,
        kv_policy: str = "preempt",
        clock: Callable[[], float] = time.monotonic,
        is_lean: bool = False,
        stream_interval: int = 1,
        grammars: SimGrammars | None = None,
        max_loras: int = 0,
        lora_cost: LoraCost | None = None,
        cache_dtype: str = "auto",
        pooling: SimPooling | None = None,
        vision: SimVision | None = None,
    ) -> None:
        """`tokenizer`: encode/decode (`LightTokenizer`, or `NullTokenizer` when nothing reads text).
        `is_lean`: timing only, for the fleet benchmark: no stop rules but max_tokens and the
        context length, no text, and an output only when a request gets its first token or ends.
        `stream_interval`: as the engine's `--stream-interval`. `grammars`: the structured outputs
        of replicas sharing this tokenizer (this engine's own when not given). `max_loras`: as the
        engine's --max-loras with --enable-lora (0: LoRA off). `lora_cost`: what adapters add to a step
        (slot loads, their products); None: nothing. `cache_dtype`: the engine's --kv-cache-dtype, as
        vllm:cache_config_info labels it (`with_overrides` sized the profile's KV cache for it).
        `pooling`: an embedding model's (--runner pooling); None: the replica generates.
        `vision`: a vision-language model's images and tower; None: images are refused."""
        self.profile = profile
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = profile.max_model_len
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.is_lean = is_lean
        self.vocab_size = int(getattr(tokenizer, "vocab_size", 1 << 31))
        self.grammars = grammars or SimGrammars(tokenizer, self.vocab_size, eos_token_ids)
        self.special_ids = frozenset(eos_token_ids) | _special_ids(tokenizer)  # no logprob alternative
        self.pooling = pooling
        self.runner = "generate" if pooling is None else "pooling"
        self.embedding_size = 0 if pooling is None else pooling.embed.embedding_size
        self.embed = EmbedSpec(served_model_name) if pooling is None else pooling.embed  # tasks, labels
        # As the engine's: an encoder has no prefix cache and admits prompts only whole (the step
        # budget raised to the context length); MEAN and CLS pooling read every position.
        is_whole = pooling is not None and pooling.is_encoder
        can_cache = pooling is None or (not is_whole and pooling.pooler.pooling_type == "LAST")
        self.block_manager = BlockManager(
            profile.num_kv_blocks, profile.block_size, enable_prefix_caching and can_cache
        )
        budget = max(profile.max_num_batched_tokens, profile.max_model_len if is_whole else 0)
        self.scheduler = Scheduler(
            SchedulerConfig(
                profile.max_num_seqs,
                budget,
                kv_policy,  # type: ignore[arg-type]
                max_loras,
                can_chunk_prompts=not is_whole,
            ),
            self.block_manager,
        )
        self.requests: dict[str, Request] = {}
        self.output_processor = OutputProcessor(tokenizer, eos_token_ids, self.max_model_len, stream_interval)
        self._requests = RequestBuilder(
            tokenizer,
            self.max_model_len,
            self.vocab_size,
            self.block_manager,
            self.grammars,
            None if pooling is None else pooling.embed,
            None if vision is None else vision.images,
        )
        self.images = None if vision is None else vision.images  # the server builds a chat's images
        self.image_steps = None if vision is None else ImageSteps(vision_cost(profile, vision.config))
        self._sources: dict[str, list[int]] = {}  # request id -> the ids its outputs cycle through
        self._stats = EngineStats(
            block_size=profile.block_size,
            cache_dtype=cache_dtype,
            num_kv_blocks=profile.num_kv_blocks,
            max_loras=max_loras,
        )
        self.last_step_num_tokens = 0
        self.last_step_latencies = StepLatencies()  # what the last finished step's tokens added
        self.lora_cost = lora_cost if max_loras else None
        # The device slots as the engine's LoraSlots keeps them: lora id -> None, least recent first.
        self._lora_slots: OrderedDict[int, None] = OrderedDict()
        self.max_loras = max_loras
        self.num_lora_loads_total = 0  # adapters copied into a slot

    # -- requests -------------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora: LoraRequest | None = None,
        mm_inputs: tuple[ImageInput, ...] | None = None,
    ) -> Request:
        """Validate and build a request without touching engine state (LLMEngine's own builder:
        a replica refuses (400) what a real one refuses); its arrival on the simulation's clock.
        `mm_inputs`: its images, already built by `images` (the server's chat path)."""
        arrival = self.clock() if arrival_time is None else arrival_time
        return self._requests.build(request_id, prompt, params, arrival, lora, mm_inputs)

    def insert_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        excluded = set(self.eos_token_ids) | set(request.params.stop_token_ids)
        source = request.prompt_token_ids
        if excluded:
            source = [t for t in source if t not in excluded] or [self.vocab_size - 1]
        self._sources[request.request_id] = source
        self.requests[request.request_id] = request
        if not self.is_lean:
            self.output_processor.add(request)
        self.scheduler.add(request)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams) -> Request:
        request = self.make_request(request_id, prompt, params)
        self.insert_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.abort(request)
        counts = self.output_processor.due(request, {}, True) or {}  # what the stream interval held
        return self._finish(request, self.output_processor.build_output(request, counts, request.is_finished))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -------------------------------------------------------------------------------
    def begin_step(self) -> SimStep | None:
        """Schedule the next batch; None when nothing can run."""
        sched = self.scheduler.schedule()
        self.last_step_num_tokens = sched.num_batched_tokens
        if sched.is_empty:
            return None
        now = self.clock()
        for s in sched.scheduled:
            if s.seq.request.metrics.first_scheduled_time is None:
                s.seq.request.metrics.first_scheduled_time = now
        shape = StepShape.of(sched.scheduled)
        duration_s = self.profile.step_time_s(shape)
        if self.lora_cost is not None:
            duration_s += self._lora_time_s(self.lora_cost, sched)
        vision_s = 0.0 if self.image_steps is None else self.image_steps.step_time_s(sched.scheduled)
        return SimStep(sched, shape, duration_s + vision_s, vision_s)

    def _lora_time_s(self, cost: LoraCost, sched: SchedulerOutput) -> float:
        """What the step's adapters add: each not in a slot is copied into the least recently used
        one (the scheduler keeps a step's adapters within max_loras, so one not in this step frees)."""
        tokens: dict[int, int] = {}
        for s in sched.scheduled:
            lora_id = s.lora_id()
            if lora_id is not None:
                tokens[lora_id] = tokens.get(lora_id, 0) + s.num_new_tokens
        num_loads = 0
        for lora_id in tokens:
            if lora_id in self._lora_slots:
                self._lora_slots.move_to_end(lora_id)
                continue
            if len(self._lora_slots) >= self.max_loras:
                victim = next((i for i in self._lora_slots if i not in tokens), None)
                if victim is not None:
                    del self._lora_slots[victim]
            self._lora_slots[lora_id] = None
            num_loads += 1
        self.num_lora_loads_total += num_loads
        return cost.step_time_s(num_loads, len(tokens), sum(tokens.values()))

    def finish_step(self, step: SimStep) -> list[RequestOutput]:
        """Commit a step begun by `begin_step` (its requests may have been aborted since)."""
        now = self.clock()
        self.last_step_latencies = StepLatencies()
        touched: dict[str, dict[int, int]] = {}
        pooled: list[RequestOutput] = []
        for s in step.scheduled.scheduled:
            seq = s.seq
            if seq.is_finished:
                continue  # aborted while the step ran
            self._score_prompt(s)
            seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.register_computed(seq)
            if s.samples and seq.request.pooling is not None:
                pooled.append(self._pool(seq, now))
            elif s.samples:
                self._append_token(seq, now, touched)
        self._stats.num_steps_total += 1
        outputs = pooled
        for request_id, counts in touched.items():
            request = self.requests[request_id]
            if self.is_lean:
                if request.is_finished or request.metrics.first_token_time == now:
                    output = RequestOutput(request_id, [], [], False, request.metrics)
                    outputs.append(self._finish(request, output) if request.is_finished else output)
                continue
            due = self.output_processor.due(request, counts, request.is_finished)
            if due is None:  # the stream interval holds it for a later step
                continue
            output = self.output_processor.build_output(request, due, request.is_finished)
            outputs.append(self._finish(request, output) if request.is_finished else output)
        return outputs

    def _append_token(self, seq: Sequence, now: float, touched: dict[str, dict[int, int]]) -> None:
        request = seq.request
        if seq.index == 0 and request.pending_forks:
            self.scheduler.fork_siblings(request)
        if self.last_step_latencies.tokens_made(request.metrics, now, 1, seq.index):
            self._stats.num_prompt_tokens_total += len(request.prompt_token_ids)  # per sequence
        if seq.grammar is not None:
            token_id = self.grammars.next_token(seq)
            self.grammars.advance(seq, token_id)
        else:
            source = self._sources[request.request_id]
            # Sampled siblings differ; greedy ones are equal, as the engine's argmax makes them.
            offset = 0 if request.params.is_greedy else seq.index
            token_id = source[(seq.num_output_tokens + offset) % len(source)]
        num_top = request.params.logprobs
        if num_top is not None and not self.is_lean:
            is_greedy = request.params.is_greedy
            seq.logprobs.append(self._logprob(token_id, num_top, is_greedy, seq.num_output_tokens))
        seq.token_ids.append(token_id)
        counts = touched.setdefault(request.request_id, {})
        counts[seq.seq_id] = counts.get(seq.seq_id, 0) + 1
        self._stats.num_generation_tokens_total += 1
        if self.is_lean:
            if (
                seq.num_output_tokens >= request.params.max_output_tokens
                or seq.num_tokens >= self.max_model_len
            ):
                seq.finish_reason = "length"
                self.scheduler.finish(seq)
        elif self.output_processor.append_token(seq, token_id):
            self.scheduler.finish(seq)
        if seq.is_finished and request.metrics.children is not None:
            request.metrics.children[seq.index].finished_time = now  # a child request's own end

    def _pool(self, seq: Sequence, now: float) -> RequestOutput:
        """A pooling request whose prompt is now computed ends with its vector (finish reason
        "stop", as the engine's `PoolingStep` ends it; a lean engine makes none: timing only)."""
        request = seq.request
        params, pooling = request.pooling, self.pooling
        seq.finish_reason = "stop"
        self.scheduler.finish(seq)
        self._stats.num_prompt_tokens_total += len(request.prompt_token_ids)
        request.metrics.first_token_time = request.metrics.last_token_time = now
        vector = None
        if not self.is_lean and params is not None and pooling is not None:
            vector = pooling.vector(request.prompt_token_ids, params)
        output = RequestOutput(
            request.request_id, request.prompt_token_ids, [], True, request.metrics, embedding=vector
        )
        return self._finish(request, output)

    def _score_prompt(self, scheduled: ScheduledSeq) -> None:
        """prompt_logprobs for the prompt positions this chunk computes, as the engine scores them."""
        seq = scheduled.seq
        k = seq.request.params.prompt_logprobs
        if k is None or self.is_lean:
            return
        for q in scheduled.prompt_positions():
            # A prompt's tokens are text, not the model's argmax: ranked like sampled ones.
            seq.prompt_logprobs.append(self._logprob(seq.token_ids[q + 1], k, False, q + 1))

    def _logprob(self, token_id: int, num_top: int, is_greedy: bool, position: int) -> TokenLogprob:
        return synthetic_logprob(
            token_id, num_top, self.vocab_size, self.special_ids, is_greedy=is_greedy, position=position
        )

    def _finish(self, request: Request, output: RequestOutput) -> RequestOutput:
        request.metrics.finish(self.clock())
        for seq in request.seqs:
            self.output_processor.release(seq.seq_id)
            if self.image_steps is not None and request.mm_inputs:
                self.image_steps.release(seq.seq_id)
            reason = seq.finish_reason or "abort"
            self._stats.finished_by_reason[reason] = self._stats.finished_by_reason.get(reason, 0) + 1
        del self.requests[request.request_id]
        self._sources.pop(request.request_id, None)
        output.finished = True
        return output

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats.observe(self.scheduler, self.block_manager)


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's special tokens (BOS, EOS, ...), where it has a `tokenizers` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return frozenset()
    return frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)


class NullTokenizer:
    """For runs that read no text (the fleet benchmark): token ids in, empty text out."""

    vocab_size = 1 << 31

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequestError("this simulated engine takes token ids only", "prompt")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""
