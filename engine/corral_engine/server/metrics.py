"""Prometheus metrics under vLLM's names (see corral_engine.wire), on the server's own registry.

Gauges and cumulative counters are read from one EngineStats snapshot at scrape time, so they are
never stale (as of the last engine step). Time to first token and inter-token latency are observed
per step from the latencies the engine took as it made the tokens (`StepLatencies`); the other
latency and size histograms from each request's RequestOutput.metrics when it finishes. Every
known label set has a series from the first scrape, at zero, so dashboards show zeros, not "No data".
The `vllm:*` series carry vLLM's labels, `model_name` and `engine` (one engine core: "0").
The process's own figures (`process_resident_memory_bytes`, CPU, file descriptors) are
prometheus_client's, as on vLLM's /metrics: the serving process's, which holds the model on CPU
(with the engine core in a process of its own, on GPUs, not the core's).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from corral_engine import wire
from corral_engine.gc_pauses import GcPauseCollector
from corral_engine.outputs import EngineStats, FinishReason, RequestMetrics, RequestOutput, StepLatencies
from corral_engine.sampling_params import SamplingParams

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)
# Why the server refused an API request before it reached the engine (label `reason`).
RejectionReason = Literal["invalid", "unauthorized", "unknown_model", "queue_full", "unavailable"]
REJECTION_REASONS: tuple[RejectionReason, ...] = get_args(RejectionReason)

# Histogram upper bounds in seconds (vLLM's choices, so dashboards' quantiles line up).
# fmt: off
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
# Tokens per engine step: vLLM's default CUDA-graph capture sizes up to 16384.
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)
STEP_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
VLLM_REQUEST_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on
# The per-request time histograms (end to end, queue, prefill, decode, inference). vLLM's bounds
# start at 0.3 s, under which a quantile is a straight line from 0: an idle engine's few-ms queue
# wait read as 0.15 s at p50 and 0.3 s at p99, and so did a 20 ms prefill. The bounds below 0.3 s
# are Corral's; the rest are vLLM's, so a query on one of vLLM's bounds (le="0.5") reads the same.
REQUEST_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, *VLLM_REQUEST_BUCKETS_S)
N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)  # vLLM's, for `vllm:request_params_n`
VLLM_LABELS = [wire.MODEL_NAME_LABEL, wire.ENGINE_LABEL]


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (a count histogram's upper bounds)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out) or (1.0,)
            out.append(float(value))
        exponent += 1


class StepHistogram(Collector):
    """A histogram of one model's series observed a step's values at a time: one lock and a
    `bisect` per value, ~0.25 us a value in all where prometheus_client's `Histogram.observe` takes
    ~1.4 us (2 vCPU AMD EPYC, Zen 3). The token-latency histograms get a value per token of every
    step, on the thread that runs or receives the steps: 256 decodes a step cost ~65 us instead of
    ~0.36 ms. Exposed as a histogram family like any other (buckets, count, sum)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str) -> None:
        self._name, self._doc, self._model = name, doc, model_name
        self._upper = sorted(buckets)
        self._les = [*(floatToGoString(b) for b in self._upper), "+Inf"]
        self._counts = [0] * (len(self._upper) + 1)  # per bucket, not cumulative; the last is +Inf's
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        """Thread-safe. A value falls in the first bucket whose upper bound is >= it (`le`)."""
        if not values:
            return
        upper, counts = self._upper, self._counts
        with self._lock:
            for value in values:
                counts[bisect.bisect_left(upper, value)] += 1
            self._sum += sum(values)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=VLLM_LABELS)
        family.add_metric(
            [self._model, wire.ENGINE_INDEX],
            list(zip(self._les, itertools.accumulate(counts), strict=True)),
            total,
        )
        yield family


class _SnapshotCollector(Collector):
    """Gauges and counters that mirror one EngineStats snapshot per scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def describe(self) -> list[Metric]:
        return []

    def _gauge(self, name: str, doc: str, value: float, is_vllm: bool = True) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=VLLM_LABELS if is_vllm else [wire.MODEL_NAME_LABEL])
        family.add_metric([self._model, wire.ENGINE_INDEX] if is_vllm else [self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float, is_vllm: bool = True) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=VLLM_LABELS if is_vllm else [wire.MODEL_NAME_LABEL])
        family.add_metric([self._model, wire.ENGINE_INDEX] if is_vllm else [self._model], value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        model = [self._model, wire.ENGINE_INDEX]
        yield self._gauge(wire.NUM_REQUESTS_RUNNING, "Requests being generated now.", s.num_running)
        yield self._gauge(wire.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge(
            wire.KV_CACHE_USAGE_PERC, "KV usage 0-1; unreferenced cached blocks are free.", s.kv_usage_ratio
        )
        info = GaugeMetricFamily(
            wire.CACHE_CONFIG_INFO,
            "KV-cache configuration.",
            labels=[*VLLM_LABELS, "block_size", "cache_dtype", "num_gpu_blocks"],
        )
        info.add_metric([*model, str(s.block_size), s.cache_dtype, str(s.num_kv_blocks)], 1.0)
        yield info
        yield self._counter(
            wire.NUM_PREEMPTIONS_TOTAL, "Preemptions of running requests.", s.num_preemptions_total
        )
        yield self._counter(wire.PROMPT_TOKENS_TOTAL, "Prompt tokens processed.", s.num_prompt_tokens_total)
        yield self._counter(wire.GENERATION_TOKENS_TOTAL, "Tokens generated.", s.num_generation_tokens_total)
        success = CounterMetricFamily(
            wire.REQUEST_SUCCESS_TOTAL,
            "Finished requests by reason.",
            labels=[*VLLM_LABELS, "finished_reason"],
        )
        reasons = dict.fromkeys(FINISH_REASONS, 0) | dict(s.finished_by_reason)
        for reason, count in sorted(reasons.items()):
            success.add_metric([*model, reason], count)
        yield success
        yield self._counter(
            wire.PREFIX_CACHE_QUERIES_TOTAL,
            "Prompt tokens looked up in the prefix cache.",
            s.num_prefix_cache_queries_total,
        )
        yield self._counter(
            wire.PREFIX_CACHE_HITS_TOTAL, "Prompt tokens found cached.", s.num_prefix_cache_hits_total
        )
        yield self._gauge(
            wire.NUM_KV_BLOCKS_FREE, "Free KV blocks (cached included).", s.num_free_blocks, is_vllm=False
        )
        yield self._gauge(
            wire.NUM_KV_BLOCKS_CACHED,
            "KV blocks holding cached prefixes.",
            s.num_cached_blocks,
            is_vllm=False,
        )
        yield self._counter(wire.NUM_STEPS_TOTAL, "Engine steps run.", s.num_steps_total, is_vllm=False)
        yield from self._spec_decode(s)
        if s.max_loras:  # --enable-lora: vLLM's one series, the latest state, valued at its time
            lora = GaugeMetricFamily(
                wire.LORA_REQUESTS_INFO,
                "Running stats on LoRA requests.",
                labels=[wire.LORA_MAX_LABEL, wire.LORA_RUNNING_LABEL, wire.LORA_WAITING_LABEL],
            )
            lora.add_metric(
                [str(s.max_loras), s.running_lora_adapters, s.waiting_lora_adapters], s.lora_changed_time_s
            )
            yield lora

    def _spec_decode(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (zeros without --speculative, but for positions)."""
        yield self._counter(
            wire.SPEC_DECODE_NUM_DRAFTS_TOTAL,
            "Speculative drafts verified: one per sequence per step it had drafts.",
            s.num_spec_drafts_total,
        )
        yield self._counter(
            wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL,
            "Speculative draft tokens verified (0 without --speculative).",
            s.num_spec_proposed_total,
        )
        yield self._counter(
            wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL,
            "Speculative draft tokens accepted.",
            s.num_spec_accepted_total,
        )
        per_pos = CounterMetricFamily(
            wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL,
            "Drafts whose token at this position was accepted.",
            labels=[*VLLM_LABELS, "position"],
        )
        for position, count in enumerate(s.num_spec_accepted_per_pos):
            per_pos.add_metric([self._model, wire.ENGINE_INDEX, str(position)], count)
        if s.num_spec_accepted_per_pos:
            yield per_pos


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(stats, model_name))
        self.registry.register(GcPauseCollector(wire.GC_PAUSE_SECONDS, {wire.MODEL_NAME_LABEL: model_name}))
        ProcessCollector(registry=self.registry)
        self._model, self._max_model_len = model_name, max_model_len

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            """A vLLM-named histogram's one series (this model, engine core 0)."""
            family = Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=self.registry)
            return family.labels(model_name, wire.ENGINE_INDEX)

        tokens = token_buckets(max_model_len)
        self._ttft = StepHistogram(
            wire.TIME_TO_FIRST_TOKEN_SECONDS, "Time to first token.", TTFT_BUCKETS_S, model_name
        )
        self._itl = StepHistogram(
            wire.INTER_TOKEN_LATENCY_SECONDS, "Time between output tokens.", ITL_BUCKETS_S, model_name
        )
        self.registry.register(self._ttft)
        self.registry.register(self._itl)
        self._e2e_m = hist(wire.E2E_REQUEST_LATENCY_SECONDS, "Arrival to finish.", REQUEST_BUCKETS_S)
        self._queue_m = hist(
            wire.REQUEST_QUEUE_TIME_SECONDS, "Arrival to first scheduled.", REQUEST_BUCKETS_S
        )
        self._prompt_m = hist(wire.REQUEST_PROMPT_TOKENS, "Prompt tokens per request.", tokens)
        self._generation_m = hist(wire.REQUEST_GENERATION_TOKENS, "Generated tokens per request.", tokens)
        self._tpot_m = hist(
            wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Decode time over output tokens after the first, per request of two tokens or more.",
            ITL_BUCKETS_S,
        )
        self._prefill_m = hist(
            wire.REQUEST_PREFILL_TIME_SECONDS, "First scheduled to first token.", REQUEST_BUCKETS_S
        )
        self._decode_m = hist(
            wire.REQUEST_DECODE_TIME_SECONDS, "First token to last token.", REQUEST_BUCKETS_S
        )
        self._inference_m = hist(
            wire.REQUEST_INFERENCE_TIME_SECONDS, "First scheduled to last token.", REQUEST_BUCKETS_S
        )
        self._kv_computed_m = hist(
            wire.REQUEST_PREFILL_KV_COMPUTED_TOKENS, "Prompt tokens computed, prefix-cache hits not.", tokens
        )
        self._max_tokens_m = hist(
            wire.REQUEST_PARAMS_MAX_TOKENS, "The max_tokens a request ran with.", tokens
        )
        self._n_m = hist(wire.REQUEST_PARAMS_N, "The n request parameter.", N_BUCKETS)
        self._max_generation_m = hist(
            wire.REQUEST_MAX_NUM_GENERATION_TOKENS,
            "The longest of a request's n sequences, in tokens.",
            tokens,
        )
        self._iteration_tokens_m = hist(
            wire.ITERATION_TOKENS_TOTAL, "Tokens computed per engine step.", ITERATION_TOKENS_BUCKETS
        )
        self._step_m = Histogram(
            wire.STEP_DURATION_SECONDS,
            "Wall time of one engine step (schedule, forward, sample, detokenize).",
            [wire.MODEL_NAME_LABEL],
            buckets=STEP_BUCKETS_S,
            registry=self.registry,
        ).labels(model_name)
        self._rejected = Counter(
            wire.NUM_REQUESTS_REJECTED_TOTAL,
            "Requests refused before reaching the engine, by reason.",
            [wire.MODEL_NAME_LABEL, "reason"],
            registry=self.registry,
        )
        for reason in REJECTION_REASONS:
            self._rejected.labels(model_name, reason)

    def observe_step(
        self, duration_s: float, num_tokens: int, latencies: StepLatencies | None = None
    ) -> None:
        """Thread-safe: called on the thread that receives the engine's steps. The token latencies
        come from the step that made the tokens (engine timestamps), not from the outputs the
        server sees, which may hold several steps' tokens or none until the end."""
        if num_tokens:
            self._step_m.observe(duration_s)
            self._iteration_tokens_m.observe(num_tokens)
        if latencies is not None:
            self._ttft.observe_many(latencies.ttft_s)
            self._itl.observe_many(latencies.itl_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_rejected(self, reason: RejectionReason) -> None:
        self._rejected.labels(self._model, reason).inc()

    def observe_finished(self, out: RequestOutput, params: SamplingParams | None = None) -> None:
        """A finished request's latencies and sizes, once per sequence: vLLM v1 runs an n > 1
        request as n child requests and records each as a request, so these histograms' counts
        add up to `vllm:request_success_total`'s stop and length series. Aborted sequences are
        left out (their latencies say when the client left, not how fast the engine was). `n` and
        the longest sequence are the parent request's, once; `params` gives max_tokens."""
        now = time.monotonic()
        num_prompt = len(out.prompt_token_ids)
        # The sequences share one prefill: the first observed computed it, the rest computed none.
        kv_computed = max(0, num_prompt - out.metrics.num_cached_tokens)
        if out.embedding is not None:  # a pooling request: its prompt, no generation
            self._observe_pooled(out.metrics, num_prompt, kv_computed, now)
            return
        max_tokens = None
        if params is not None:
            max_tokens = params.max_tokens or max(0, self._max_model_len - num_prompt)
        longest = None
        for o in out.outputs:
            if o.finish_reason == "abort":
                continue
            child = out.metrics.child(o.index)
            finished = child.finished_time if child.finished_time is not None else now
            self._e2e_m.observe(max(0.0, finished - child.arrival_time))
            if child.first_scheduled_time is not None:
                self._queue_m.observe(max(0.0, child.first_scheduled_time - child.arrival_time))
            self._prompt_m.observe(num_prompt)
            self._generation_m.observe(len(o.token_ids))
            self._kv_computed_m.observe(kv_computed)
            kv_computed = 0
            if max_tokens:
                self._max_tokens_m.observe(max_tokens)
            longest = max(longest or 0, len(o.token_ids))
            self._observe_phases(child, len(o.token_ids))
        if longest is not None:
            self._n_m.observe(len(out.outputs))
            self._max_generation_m.observe(longest)

    def _observe_pooled(self, m: RequestMetrics, num_prompt: int, kv_computed: int, now: float) -> None:
        """A pooling request's end to end, queue time and prompt (no generation histograms)."""
        finished = m.finished_time if m.finished_time is not None else now
        self._e2e_m.observe(max(0.0, finished - m.arrival_time))
        if m.first_scheduled_time is not None:
            self._queue_m.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        self._prompt_m.observe(num_prompt)
        self._kv_computed_m.observe(kv_computed)

    def _observe_phases(self, m: RequestMetrics, num_tokens: int) -> None:
        """Prefill, decode and inference time (vLLM's split) and the mean time per output token."""
        if m.first_scheduled_time is None or m.first_token_time is None or m.last_token_time is None:
            return
        decode_s = max(0.0, m.last_token_time - m.first_token_time)
        self._prefill_m.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        self._decode_m.observe(decode_s)
        self._inference_m.observe(max(0.0, m.last_token_time - m.first_scheduled_time))
        if num_tokens > 1:
            self._tpot_m.observe(decode_s / (num_tokens - 1))
