"""The synchronous engine: add requests, step, read outputs (tests and benchmarks drive it directly).

One step: schedule -> run the model -> sample -> append tokens and check stop tokens -> detokenize
and check stop strings -> free what finished -> hand back an output per request that progressed.

With the output overlap on (`CORRAL_OVERLAP_OUTPUT`, by default on CUDA) the text half of a step
(detokenize, stop strings, outputs) runs in the next step, between queuing that step's device work
and waiting for its tokens, so the host works while the device computes; outputs come a step later.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import time
from collections.abc import Sequence as SequenceABC

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import ScheduledSeq, SchedulerOutput
from corral_engine.core.sequence import Request, Sequence
from corral_engine.engine_adapters import EngineAdapters
from corral_engine.engine_setup import (
    check_vision_args,
    context_length,
    embed_spec,
    make_scheduler,
    pipelining,
)
from corral_engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from corral_engine.image_processor import ImageProcessor
from corral_engine.lora import AdapterError, LoraRequest, startup_adapters
from corral_engine.model.batch import TokenFill
from corral_engine.model.config import load_model_config
from corral_engine.model.cuda_graphs import GraphCapture
from corral_engine.model.native import load_fused_ops
from corral_engine.model.quant import model_quant_config
from corral_engine.model.sampler import PendingSample, Sampler, record_prompt_logprobs
from corral_engine.model.tp_workers import make_runner
from corral_engine.multimodal import ImageInput
from corral_engine.output_processor import OutputProcessor
from corral_engine.outputs import EngineStats, RequestOutput, StepLatencies
from corral_engine.pooling_params import PoolingParams
from corral_engine.pooling_step import PoolingStep, can_cache_prefixes, choose_runner_for
from corral_engine.request_builder import Prompt, RequestBuilder, paired
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from corral_engine.sources.uri import parse_model_uri
from corral_engine.structured.compiler import GrammarCompiler
from corral_engine.structured.masks import StepMasks
from corral_engine.token_appender import TokenAppender, Touched, sampling_rows
from corral_engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        args: EngineArgs,
        settings: EngineSettings | None = None,
        graph_capture: GraphCapture | None = None,
    ) -> None:
        """`settings`: the CORRAL_* switches; read from the environment when not given.
        `graph_capture`: what records decode graphs (CUDA graphs on CUDA; tests pass EagerCapture)."""
        self.args = args
        self.settings = settings or EngineSettings()
        logger.info("engine settings: %s", self.settings.describe())
        self._load_model(args, graph_capture)
        self._build_scheduler(args)
        # On CPU the sampler's noise comes from the native exponential race (CORRAL_NATIVE_ATTENTION=0:
        # PyTorch's exponential_, 5-10x slower), and its greedy picks from a native argmax.
        fused_ops = load_fused_ops(self.settings) if self.runner.device.type == "cpu" else None
        race = None if fused_ops is None else fused_ops.exponential_race
        argmax = None if fused_ops is None else fused_ops.argmax_rows
        self.sampler = Sampler(args.seed, self.eos_token_ids, race, argmax)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.grammar_masks = StepMasks(self.grammars)
        self.requests: dict[str, Request] = {}
        self._pooling = None if self.pooler_config is None else PoolingStep(self, self.pooler_config)
        vision = self.model_config.vision
        self.request_builder = RequestBuilder(
            self.tokenizer,
            self.max_model_len,
            self.model_config.vocab_size,
            self.block_manager,
            self.grammars,
            self.embed,
            None
            if vision is None
            else ImageProcessor(
                self.model_config.path, vision, args.max_images_per_prompt, args.allowed_media_domains
            ),
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, self.max_model_len, args.stream_interval
        )
        self.overlaps_output, self.schedules_ahead = pipelining(
            self.settings,
            self.runner.device.type == "cuda",
            self.runner.fills_inputs_on_device,
            bool(args.speculative),
        )
        # Async scheduling: the last step's sampling, not waited for yet; its sequences hold
        # PENDING_TOKEN as their newest token until this step has launched.
        self._inflight: PendingSample | None = None
        # The last step's text half, when it waits for this step (request id -> seq id -> new tokens).
        # Its requests stay in `requests` until their outputs are out.
        self._deferred: Touched = {}
        self._appender = TokenAppender(
            self.scheduler, self.output_processor, self._stats, args, self.max_model_len
        )
        self.last_step_num_tokens = 0
        # The token latencies the last step's tokens added (for the server's histograms).
        self.last_step_latencies = StepLatencies()
        self.last_schedule: list[ScheduledSeq] = []  # the last step's batch (the simulator's calibration)

    def _load_model(self, args: EngineArgs, graph_capture: GraphCapture | None) -> None:
        """The model's config, tokenizer and runner (its weights and KV cache); what the model
        cannot be served with is refused before any tensor-parallel worker starts."""
        self.model_config = load_model_config(args.model)
        # A quantization Corral cannot serve is said before the tokenizer or any worker loads.
        model_quant_config(args.quantization, self.model_config.quantization_config, self.model_config.is_moe)
        self.tokenizer = load_tokenizer(args.model)
        self.max_model_len = context_length(args, self.model_config)
        self.served_model_name = args.served_model_name or parse_model_uri(args.model).default_served_name
        self.eos_token_ids = self.model_config.eos_token_ids
        if args.enable_lora and self.model_config.is_moe:  # before any tensor-parallel worker starts
            raise ModelLoadError("--enable-lora is not supported for mixture-of-experts models yet")
        # `runner_type`, not `runner`: that name holds the model runner.
        self.runner_type, self.pooler_config = choose_runner_for(args, self.model_config)
        if self.model_config.vision is not None:  # before any worker starts
            check_vision_args(args, self.runner_type)
        self.embed = embed_spec(
            self.served_model_name, self.runner_type, self.pooler_config is not None, self.model_config
        )
        self.embedding_size = self.embed.embedding_size  # the vectors' length; 0 when generating
        runner_args = args.replace(runner=self.runner_type)  # what the model runner builds for
        self.runner = make_runner(
            self.model_config, runner_args, self.max_model_len, self.settings, graph_capture
        )
        # The runner is closed (workers stopped, model freed) by close(), when the engine is
        # collected, or at exit when it was left open: multiprocessing runs this before it
        # terminates its daemonic children, which a worker's watchdog would take for a crash.
        self._close_runner = multiprocessing.util.Finalize(self, self.runner.close, exitpriority=10)
        self.is_closed = False

    def _build_scheduler(self, args: EngineArgs) -> None:
        """The scheduler over the runner's KV blocks, the engine's counters, and the adapters
        --lora-modules names (ModelLoadError, the runner closed, for one that cannot be served)."""
        is_encoder = self.model_config.encoder is not None
        can_cache = can_cache_prefixes(args, self.pooler_config, is_encoder)
        self.scheduler = make_scheduler(
            args, self.runner.num_kv_blocks, self.max_model_len, is_encoder, can_cache
        )
        self.block_manager = self.scheduler.bm
        self._stats = EngineStats(
            block_size=args.block_size,
            cache_dtype=args.kv_cache_dtype,
            num_kv_blocks=self.runner.num_kv_blocks,
            num_spec_accepted_per_pos=[0] * (args.num_speculative_tokens if args.speculative else 0),
            max_loras=self.scheduler.config.max_loras,
        )
        self.adapters = EngineAdapters(self.runner)
        for lora in startup_adapters(args.lora_modules):
            try:
                self.adapters.add(lora)
            except AdapterError as e:
                self._close_runner()
                raise ModelLoadError(str(e)) from None

    # -- life cycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Abort the unfinished requests, stop the tensor-parallel workers, and free the weights and
        the KV cache; idempotent. New requests are refused afterwards (EngineDeadError). Also
        `with LLMEngine(args) as engine: ...`."""
        if self.is_closed:
            return
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._inflight = None
        self.is_closed = True
        self._close_runner()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.request_builder.tokenize(prompt)

    def make_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora: LoraRequest | None = None,
        mm_inputs: tuple[ImageInput, ...] | None = None,
    ) -> Request:
        """Validate and build a request without touching engine state (safe from any thread);
        `lora`: the adapter it generates with (registered with `add_lora`); `mm_inputs`: its
        images already processed (the engine core's own process), else from the prompt's
        `multi_modal_data`."""
        if self.is_closed:
            raise EngineDeadError("the engine is closed")
        return self.request_builder.build(request_id, prompt, params, arrival_time, lora, mm_inputs)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora: LoraRequest | None = None,
    ) -> Request:
        request = self.make_request(request_id, prompt, params, arrival_time, lora)
        self.insert_request(request)
        return request

    # -- LoRA adapters --------------------------------------------------------------------------
    def add_lora(self, lora: LoraRequest) -> None:
        """Read and register an adapter (from any thread); AdapterError when it cannot be served."""
        if self.is_closed:
            raise EngineDeadError("the engine is closed")
        self.adapters.add(lora)

    def remove_lora(self, lora_id: int) -> None:
        """Unregister an adapter (from any thread); its weights go once its requests are done."""
        self.adapters.remove(lora_id)

    def insert_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        if request.lora is not None:
            self.adapters.stage(request.lora)  # read again if dropped; refused if it cannot be
        self.requests[request.request_id] = request
        self.output_processor.add(request)
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        counts = self._deferred.pop(request_id, {})
        self._appender.drop_places(request.seqs)  # a token still on the device goes with it
        self._appender.detokenize(request, counts)  # the tokens it has: a stop string may have ended it
        self.scheduler.abort(request)
        counts = self.output_processor.due(request, counts, True) or {}  # with any held back
        return self._finish_request(
            request, self.output_processor.build_output(request, counts, request.is_finished)
        )

    def has_unfinished_requests(self) -> bool:
        """True until every request's final output is out (a deferred one included)."""
        return bool(self.requests)

    @property
    def step_in_flight(self) -> bool:
        """Whether the last `step()` returned with its batch still running (async scheduling):
        the next call waits for its tokens. `step_clock.StepClock` times steps with it."""
        return self._inflight is not None

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.adapters.has_removals:
            self.adapters.drop_unused(self.requests.values())
        sched = self.scheduler.schedule()
        aborted = self._abort_unservable(sched) if self.scheduler.config.max_loras else []
        self.last_step_num_tokens = sched.num_batched_tokens
        self.last_step_latencies = StepLatencies()
        self.last_schedule = sched.scheduled
        inflight, self._inflight = self._inflight, None
        if sched.is_empty:
            outputs = aborted + self._emit(self._take_deferred())
            return outputs + self._emit(self._appender.settle(inflight, self.last_step_latencies))
        now = time.monotonic()
        for s in sched.scheduled:
            metrics = s.seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        if self._pooling is not None:
            return aborted + self._pooling.step(sched)
        masks = self.grammar_masks.start(sched.scheduled)  # filled while the model runs
        scored = [
            (s.seq, s.prompt_positions())
            for s in sched.scheduled
            if s.seq.request.params.prompt_logprobs is not None
        ]
        if inflight is None:
            logits = self.runner.execute(sched.scheduled)
        else:  # this step's inputs take the last step's tokens on the device
            rows = {seq.seq_id: row for row, seq in enumerate(inflight.seqs)}
            logits = self.runner.execute(sched.scheduled, TokenFill(inflight.tokens, rows))
        plain, plain_rows, drafts, row = sampling_rows(sched.scheduled)
        # The last step's tokens (async scheduling), now that this step is queued behind them;
        # full blocks join the prefix cache only once their tokens are known.
        settled = self._appender.settle(inflight, self.last_step_latencies)
        for s in sched.scheduled:
            self.block_manager.register_computed(s.seq)
        sampled = logits[:row] if len(plain_rows) == row else logits[plain_rows]
        pending = self.sampler.queue(sampled, plain, masks.wait())
        # The device is busy with this step: the last step's text half runs meanwhile. It only
        # detokenizes, frees blocks and builds outputs; nothing takes a block before the next
        # schedule, and the device's reads of freed blocks are ordered before any later step's.
        outputs = aborted + self._emit(self._take_deferred())
        outputs += self._emit(settled)
        if self.schedules_ahead and not drafts and not scored and self._appender.can_defer(plain):
            # The next step is scheduled before these tokens reach the host: each sequence holds
            # a placeholder, which the next step's inputs replace on the device.
            self._appender.hold_places(plain)
            self._inflight = pending
            self._stats.num_steps_total += 1
            return outputs
        result = pending.wait()
        if len(logits) > row:  # prompt_logprobs rows follow the sampling rows
            record_prompt_logprobs(scored, logits[row:])
        touched = self._appender.append_sampled(plain, result, drafts, logits, self.last_step_latencies)
        self._stats.num_steps_total += 1
        if self.overlaps_output:
            self._deferred = touched
            return outputs
        return outputs + self._emit(touched)

    def _abort_unservable(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Abort the step's requests whose adapter can no longer be read (rare: see
        EngineAdapters.unservable) and take them out of the step, which then runs without them."""
        failed = self.adapters.unservable(sched.scheduled)
        if not failed:
            return []
        sched.scheduled = [s for s in sched.scheduled if s.seq.request.request_id not in failed]
        outputs = []
        for request_id, why in failed.items():
            logger.warning("request %s aborted: %s", request_id, why)
            output = self.abort_request(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def _take_deferred(self) -> Touched:
        deferred, self._deferred = self._deferred, {}
        return deferred

    def _emit(self, touched: Touched) -> list[RequestOutput]:
        """A step's text half: `touched` (request id -> seq id -> its new tokens) detokenized,
        stop strings applied, and an output per request (finished ones released)."""
        outputs = []
        for request_id, counts in touched.items():
            request = self.requests[request_id]
            self._appender.detokenize(request, counts)
            is_finished = request.is_finished
            due = self.output_processor.due(request, counts, is_finished)
            if due is None:  # the stream interval holds it for a later step
                continue
            output = self.output_processor.build_output(request, due, is_finished)
            outputs.append(self._finish_request(request, output) if is_finished else output)
        return outputs

    def _finish_request(self, request: Request, output: RequestOutput) -> RequestOutput:
        request.metrics.finish(time.monotonic())
        for seq in request.seqs:
            self.output_processor.release(seq.seq_id)
            self.sampler.release(seq.seq_id)
            self.runner.release(seq.seq_id)
            if self._pooling is not None:
                self._pooling.pooler.release(seq.seq_id)
            reason = seq.finish_reason or "abort"
            self._stats.finished_by_reason[reason] = self._stats.finished_by_reason.get(reason, 0) + 1
        del self.requests[request.request_id]
        output.finished = True
        return output

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats.observe(self.scheduler, self.block_manager)

    # -- convenience ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | SequenceABC[Prompt],
        params: SamplingParams | PoolingParams | SequenceABC[SamplingParams | PoolingParams],
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (the final output of each). A string
        is one prompt, as in vLLM (not one per character). Every prompt is checked before any is
        queued, so a refused one raises with nothing left behind to run in a later call."""
        prompt_list, param_list = paired(prompts, params)
        ids = [f"gen-{self.request_builder.next_arrival()}-{i}" for i in range(len(prompt_list))]
        requests = [
            self.make_request(i, p, sp) for i, p, sp in zip(ids, prompt_list, param_list, strict=True)
        ]
        for request in requests:
            self.insert_request(request)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if not s.is_finished]
