"""The synchronous engine: add requests, step, read outputs (tests and benchmarks drive it directly).

One step: schedule -> run the model -> sample -> append tokens and check stop tokens -> detokenize
and check stop strings -> free what finished -> hand back an output per request that progressed.

With the output overlap on (`CORRAL_OVERLAP_OUTPUT`, by default on CUDA) the text half of a step
(detokenize, stop strings, outputs) runs in the next step, between queuing that step's device work
and waiting for its tokens, so the host works while the device computes; outputs come a step later.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.util
import time
from collections import deque
from collections.abc import Sequence as SequenceABC

import torch

from corral_engine.args import EngineArgs
from corral_engine.core import ngram
from corral_engine.core.block_manager import BlockManager
from corral_engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from corral_engine.core.sequence import Request, Sequence
from corral_engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from corral_engine.lora import AdapterError, LoraRequest, startup_adapters
from corral_engine.model.batch import PENDING_TOKEN, TokenFill
from corral_engine.model.config import load_model_config
from corral_engine.model.cuda_graphs import GraphCapture
from corral_engine.model.native import load_fused_ops
from corral_engine.model.sampler import PendingSample, Sampler, SampleResult, token_logprob
from corral_engine.model.tp_workers import make_runner
from corral_engine.output_processor import OutputProcessor
from corral_engine.outputs import EngineStats, RequestMetrics, RequestOutput, StepLatencies
from corral_engine.request_checks import check_request
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from corral_engine.sources.uri import parse_model_uri
from corral_engine.structured.compiler import GrammarCompiler
from corral_engine.structured.masks import StepMasks, advance
from corral_engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


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
        self.model_config = load_model_config(args.model)
        self.tokenizer = load_tokenizer(args.model)
        self.max_model_len = min(
            args.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        if args.max_model_len and args.max_model_len > self.max_model_len:
            logger.warning(
                "--max-model-len %d is past the model's %d positions: serving %d",
                args.max_model_len, self.max_model_len, self.max_model_len,
            )  # fmt: skip
        self.served_model_name = args.served_model_name or parse_model_uri(args.model).default_served_name
        self.eos_token_ids = self.model_config.eos_token_ids
        if args.enable_lora and self.model_config.is_moe:  # before any tensor-parallel worker starts
            raise ModelLoadError("--enable-lora is not supported for mixture-of-experts models yet")
        self.runner = make_runner(self.model_config, args, self.max_model_len, self.settings, graph_capture)
        # The runner is closed (workers stopped, model freed) by close(), when the engine is
        # collected, or at exit when it was left open: multiprocessing runs this before it
        # terminates its daemonic children, which a worker's watchdog would take for a crash.
        self._close_runner = multiprocessing.util.Finalize(self, self.runner.close, exitpriority=10)
        self.is_closed = False
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, args.block_size, args.enable_prefix_caching
        )
        kv_tokens = self.runner.num_kv_blocks * args.block_size
        if kv_tokens < self.max_model_len:  # vLLM refuses to start; a test may want a tiny cache
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len %d: a request longer than "
                "that is refused (give the cache more memory or set --max-model-len %d)",
                kv_tokens, self.max_model_len, kv_tokens,
            )  # fmt: skip
        max_loras = args.max_loras if args.enable_lora else 0
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.kv_policy, max_loras),
            self.block_manager,
        )
        for lora in startup_adapters(args.lora_modules):
            try:
                self.runner.add_lora(lora)
            except AdapterError as e:
                self._close_runner()
                raise ModelLoadError(str(e)) from None
        # Adapters unloaded (thread-safe queue), dropped once no request of theirs is left.
        self._lora_removals: deque[int] = deque()
        self._removing_loras: set[int] = set()
        # On CPU the sampler's noise comes from the native exponential race (CORRAL_NATIVE_ATTENTION=0:
        # PyTorch's exponential_, 5-10x slower).
        fused_ops = load_fused_ops(self.settings) if self.runner.device.type == "cpu" else None
        race = None if fused_ops is None else fused_ops.exponential_race
        self.sampler = Sampler(args.seed, self.eos_token_ids, race)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.grammar_masks = StepMasks(self.grammars)
        self.requests: dict[str, Request] = {}
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, self.max_model_len, args.stream_interval
        )
        # On CPU the forward pass runs inside runner.execute: no idle device to overlap with.
        overlap = self.settings.overlap_output
        self.overlaps_output = overlap == "1" or (overlap == "auto" and self.runner.device.type == "cuda")
        logger.info("output overlap: %s", "on" if self.overlaps_output else "off")
        mode = self.settings.async_scheduling
        self.schedules_ahead = (
            (mode == "1" or (mode == "auto" and self.runner.device.type == "cuda"))
            and self.runner.fills_inputs_on_device
            and not args.speculative
        )
        logger.info("async scheduling: %s", "on" if self.schedules_ahead else "off")
        # Async scheduling: the last step's sampling, not waited for yet; its sequences hold
        # PENDING_TOKEN as their newest token until this step has launched.
        self._inflight: PendingSample | None = None
        # The last step's text half, when it waits for this step (request id -> seq id -> new tokens).
        # Its requests stay in `requests` until their outputs are out.
        self._deferred: dict[str, dict[int, int]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._stats = EngineStats(
            block_size=args.block_size,
            num_kv_blocks=self.runner.num_kv_blocks,
            num_spec_accepted_per_pos=[0] * (args.num_speculative_tokens if args.speculative else 0),
            max_loras=max_loras,
        )
        self.last_step_num_tokens = 0
        # The token latencies the last step's tokens added (for the server's histograms).
        self.last_step_latencies = StepLatencies()
        self.last_schedule: list[ScheduledSeq] = []  # the last step's batch (the simulator's calibration)

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
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def make_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora: LoraRequest | None = None,
    ) -> Request:
        """Validate and build a request without touching engine state (safe from any thread);
        `lora`: the adapter it generates with (registered with `add_lora`)."""
        if self.is_closed:
            raise EngineDeadError("the engine is closed")
        token_ids = self.tokenize(prompt)
        params = check_request(
            token_ids, params, self.max_model_len, self.model_config.vocab_size, self.block_manager
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_order=next(self._arrivals),
            metrics=RequestMetrics.for_sequences(arrival_time or time.monotonic(), params.n),
            lora=lora,
        )
        request.seqs = [
            Sequence(next(self._seq_ids), request, i, list(token_ids), len(token_ids))
            for i in range(params.n)
        ]
        self.grammars.attach(request)
        return request

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
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
        self.runner.add_lora(lora)

    def remove_lora(self, lora_id: int) -> None:
        """Unregister an adapter (from any thread); its weights go once its requests are done."""
        self._lora_removals.append(lora_id)

    def _drop_unused_loras(self) -> None:
        while self._lora_removals:
            self._removing_loras.add(self._lora_removals.popleft())
        in_use = {r.lora.lora_id for r in self.requests.values() if r.lora is not None}
        for lora_id in self._removing_loras - in_use:
            self.runner.remove_lora(lora_id)
        self._removing_loras &= in_use

    def insert_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        self.requests[request.request_id] = request
        self.output_processor.add(request)
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        counts = self._deferred.pop(request_id, {})
        for seq in request.seqs:  # a token still on the device is dropped with the request
            if seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
                seq.token_ids.pop()
        self._detokenize(request, counts)  # the tokens it has: a stop string may have ended it
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
        if self._lora_removals or self._removing_loras:
            self._drop_unused_loras()
        sched = self.scheduler.schedule()
        self.last_step_num_tokens = sched.num_batched_tokens
        self.last_step_latencies = StepLatencies()
        self.last_schedule = sched.scheduled
        inflight, self._inflight = self._inflight, None
        if sched.is_empty:
            outputs = self._emit(self._take_deferred())
            return outputs + self._emit(self._settle(inflight))
        now = time.monotonic()
        for s in sched.scheduled:
            metrics = s.seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
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
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        drafts: list[tuple[ScheduledSeq, int]] = []  # (scheduled, first logits row)
        row = 0
        for s in sched.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens - s.num_spec  # drafts count once verified
            if not s.samples:
                continue
            if s.num_spec:
                drafts.append((s, row))
            else:
                plain.append(seq)
                plain_rows.append(row)
            row += 1 + s.num_spec
        # The last step's tokens (async scheduling), now that this step is queued behind them;
        # full blocks join the prefix cache only once their tokens are known.
        settled = self._settle(inflight)
        for s in sched.scheduled:
            self.block_manager.register_computed(s.seq)
        sampled = logits[:row] if len(plain_rows) == row else logits[plain_rows]
        pending = self.sampler.queue(sampled, plain, masks.wait())
        # The device is busy with this step: the last step's text half runs meanwhile. It only
        # detokenizes, frees blocks and builds outputs; nothing takes a block before the next
        # schedule, and the device's reads of freed blocks are ordered before any later step's.
        outputs = self._emit(self._take_deferred())
        outputs += self._emit(settled)
        if self._can_schedule_ahead(plain, drafts, scored):
            # The next step is scheduled before these tokens reach the host: each sequence holds
            # a placeholder, which the next step's inputs replace on the device.
            for seq in plain:
                if not seq.is_finished:
                    seq.token_ids.append(PENDING_TOKEN)
            self._inflight = pending
            self._stats.num_steps_total += 1
            return outputs
        result = pending.wait()
        if len(logits) > row:  # prompt_logprobs rows follow the sampling rows
            self._record_prompt_logprobs(scored, logits[row:])
        touched = self._append_sampled(plain, result, drafts, logits)
        self._stats.num_steps_total += 1
        if self.overlaps_output:
            self._deferred = touched
            return outputs
        return outputs + self._emit(touched)

    def _append_sampled(
        self,
        plain: list[Sequence],
        result: SampleResult,
        drafts: list[tuple[ScheduledSeq, int]],
        logits: torch.Tensor | None,
    ) -> dict[str, dict[int, int]]:
        """Append the step's new tokens; request id -> seq id -> how many each sequence gained."""
        now = time.monotonic()
        touched: dict[str, dict[int, int]] = {}
        for seq, token_id, logprob in zip(plain, result.token_ids, result.logprobs, strict=True):
            if seq.is_finished:
                continue  # a stop string in the last step's text ended it: this token is dropped
            if logprob is not None:
                seq.logprobs.append(logprob)
            self._append_tokens(seq, [token_id], now, touched)
        for s, first_row in drafts:
            assert logits is not None
            if not s.seq.is_finished:
                tokens = self._verify(s, logits[first_row : first_row + 1 + s.num_spec])
                self._append_tokens(s.seq, tokens, now, touched)
        return touched

    def _settle(self, inflight: PendingSample | None) -> dict[str, dict[int, int]]:
        """Wait for the last step's tokens (`inflight`: async scheduling) and append them in
        place of their placeholders; what `_append_sampled` returns."""
        if inflight is None:
            return {}
        result = inflight.wait()
        for seq in inflight.seqs:
            if seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
                seq.token_ids.pop()
        return self._append_sampled(inflight.seqs, result, [], None)

    def _can_schedule_ahead(
        self,
        plain: list[Sequence],
        drafts: list[tuple[ScheduledSeq, int]],
        scored: list[tuple[Sequence, range]],
    ) -> bool:
        """Whether the next step may be scheduled before this step's tokens are known: only when
        nothing the next schedule or batch reads depends on them (grammars, drafts, logprobs) and
        no sequence ends by length with this token (it would be scheduled once more for nothing)."""
        if not self.schedules_ahead or not plain or drafts or scored:
            return False
        for seq in plain:
            params = seq.request.params
            if seq.grammar is not None or params.logprobs is not None or seq.request.pending_forks:
                return False
            if (
                seq.num_output_tokens + 1 >= params.max_output_tokens
                or seq.num_tokens + 1 >= self.max_model_len
            ):
                return False
        return True

    def _take_deferred(self) -> dict[str, dict[int, int]]:
        deferred, self._deferred = self._deferred, {}
        return deferred

    def _emit(self, touched: dict[str, dict[int, int]]) -> list[RequestOutput]:
        """A step's text half: `touched` (request id -> seq id -> its new tokens) detokenized,
        stop strings applied, and an output per request (finished ones released)."""
        outputs = []
        for request_id, counts in touched.items():
            request = self.requests[request_id]
            self._detokenize(request, counts)
            is_finished = request.is_finished
            due = self.output_processor.due(request, counts, is_finished)
            if due is None:  # the stream interval holds it for a later step
                continue
            output = self.output_processor.build_output(request, due, is_finished)
            outputs.append(self._finish_request(request, output) if is_finished else output)
        return outputs

    def _detokenize(self, request: Request, counts: dict[int, int]) -> None:
        """Detokenize the request's new tokens; a stop string ends its sequence there, and any
        tokens after it (accepted drafts) are dropped, as if they had never been appended."""
        children = request.metrics.children
        for seq in request.seqs:
            num_new = counts.get(seq.seq_id, 0)
            num_dropped = self.output_processor.detokenize(seq, num_new) if num_new else None
            if num_dropped is not None:
                if num_dropped:
                    del seq.token_ids[-num_dropped:]
                    del seq.logprobs[seq.num_output_tokens :]
                    counts[seq.seq_id] = num_new - num_dropped
                    self._stats.num_generation_tokens_total -= num_dropped
                if not seq.is_finished:
                    self.scheduler.finish(seq)
            if children is not None and num_new and seq.is_finished:
                # A child request (n > 1) ends with its text, as the request does in _finish_request.
                children[seq.index].finished_time = time.monotonic()

    def _record_prompt_logprobs(self, scored: list[tuple[Sequence, range]], logits: torch.Tensor) -> None:
        raw = torch.log_softmax(logits, dim=-1).cpu()  # [rows, V]
        i = 0
        for seq, positions in scored:
            k = seq.request.params.prompt_logprobs or 0
            for q in positions:
                seq.prompt_logprobs.append(token_logprob(raw[i], seq.token_ids[q + 1], k))
                i += 1

    def _verify(self, s: ScheduledSeq, logits: torch.Tensor) -> list[int]:
        """Greedy verification: keep the drafts the model agrees with, plus its own next token."""
        seq = s.seq
        greedy = logits.argmax(dim=-1).tolist()  # [1 + num_spec]
        drafts = seq.spec_token_ids[: s.num_spec]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        seq.num_computed_tokens += accepted  # the accepted drafts' KV is valid; the rest is dropped
        self._stats.num_spec_proposed_total += len(drafts)
        self._stats.num_spec_accepted_total += accepted
        if drafts:
            self._stats.num_spec_drafts_total += 1
            per_pos = self._stats.num_spec_accepted_per_pos
            for position in range(accepted):
                per_pos[position] += 1
        return [*drafts[:accepted], greedy[accepted]]

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], now: float, touched: dict[str, dict[int, int]]
    ) -> None:
        request = seq.request
        if seq.index == 0 and request.pending_forks:
            self.scheduler.fork_siblings(request)
        counts = touched.setdefault(request.request_id, {})
        seq.spec_token_ids = []
        num_appended = 0
        for token_id in tokens:
            seq.token_ids.append(token_id)
            num_appended += 1
            if seq.grammar is not None:
                advance(seq, token_id)
            if self.output_processor.check_stop_token(seq, token_id):  # stop strings: _detokenize
                self.scheduler.finish(seq)
            if seq.is_finished:
                break
        counts[seq.seq_id] = counts.get(seq.seq_id, 0) + num_appended
        self._stats.num_generation_tokens_total += num_appended
        if self.last_step_latencies.tokens_made(request.metrics, now, num_appended, seq.index):
            # Counted once its prefill is done, as vLLM does: the counter's rate is prefill work,
            # not arrivals (a burst of 200 requests would otherwise look like one busy interval).
            # Once per sequence, as vLLM v1 counts each child request's prompt.
            self._stats.num_prompt_tokens_total += len(request.prompt_token_ids)
        if seq.is_finished:
            return
        if self.args.speculative and request.params.can_speculate:
            room = (
                min(
                    request.params.max_output_tokens - seq.num_output_tokens,
                    self.max_model_len - seq.num_tokens,
                )
                - 1
            )
            seq.spec_token_ids = ngram.propose(
                seq.token_ids,
                min(self.args.num_speculative_tokens, room),
                min_ngram=self.args.prompt_lookup_min,
                max_ngram=self.args.prompt_lookup_max,
            )

    def _finish_request(self, request: Request, output: RequestOutput) -> RequestOutput:
        request.metrics.finish(time.monotonic())
        for seq in request.seqs:
            self.output_processor.release(seq.seq_id)
            self.sampler.release(seq.seq_id)
            self.runner.release(seq.seq_id)
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
        params: SamplingParams | SequenceABC[SamplingParams],
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (the final output of each). A string
        is one prompt, as in vLLM (not one per character). Every prompt is checked before any is
        queued, so a refused one raises with nothing left behind to run in a later call."""
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} SamplingParams")
        ids = [f"gen-{next(self._arrivals)}-{i}" for i in range(len(prompt_list))]
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
