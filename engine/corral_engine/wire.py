"""The fleet's wire contract between engine, gateway and operator (light: no torch, no I/O): metric
names and load headers (vLLM's, so tools built for vLLM read a Corral engine unchanged), the
LLMDeployment API, the labels and annotation the operator and gateway share, and when a pod serves."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")

# Label carried by every engine metric.
MODEL_NAME_LABEL = "model_name"
# vLLM's engine-core index, on every `vllm:*` series (vLLM 0.10+; a data-parallel vLLM pod has one per
# core). A Corral engine has one core: "0". Readers that sum over label sets are unaffected.
ENGINE_LABEL = "engine"
ENGINE_INDEX = "0"

# Gauges.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # a 0-1 fraction, despite the name
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # labels: block_size, cache_dtype, num_gpu_blocks

# Counters (exposed with the `_total` suffix).
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"  # label: finished_reason
PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"

# Histograms (exposed as `_bucket`, `_sum`, `_count`).
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:request_time_per_output_token_seconds"
REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"  # first scheduled -> first token
REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"  # first token -> last token
REQUEST_INFERENCE_TIME_SECONDS = "vllm:request_inference_time_seconds"  # first scheduled -> last token
# Per request (each of an n > 1 request's sequences): its prompt tokens less the prefix-cache hits.
REQUEST_PREFILL_KV_COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"
# Per sequence: the max_tokens it ran with (the room the context left where the client gave none).
REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
# Per request, once its sequences have all finished: its `n`, and its longest sequence's tokens.
REQUEST_PARAMS_N = "vllm:request_params_n"
REQUEST_MAX_NUM_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
# A histogram despite the suffix (vLLM's name): tokens computed per engine step.
ITERATION_TOKENS_TOTAL = "vllm:iteration_tokens_total"

# Speculative decoding (n-gram drafts), counters as vLLM names them. A draft is one sequence's
# proposal verified in one step; mean acceptance length = 1 + accepted tokens / drafts.
SPEC_DECODE_NUM_DRAFTS_TOTAL = "vllm:spec_decode_num_drafts_total"
SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL = "vllm:spec_decode_num_accepted_tokens_total"
# Drafts whose token at label `position` (0 = first) was accepted; over drafts, the acceptance rate
# by position. A series per position up to --num-speculative-tokens, with --speculative only.
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

# LoRA adapters, as vLLM reports them (the Gateway API Inference Extension's LoRA affinity reads
# it): one gauge whose value is the time (Unix seconds) of its latest change and whose labels carry
# the state, adapter names comma-separated.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_MAX_LABEL = "max_lora"  # adapters one step may run
LORA_RUNNING_LABEL = "running_lora_adapters"  # adapters of the running requests
LORA_WAITING_LABEL = "waiting_lora_adapters"  # adapters of the waiting requests

# Corral-specific metrics where vLLM has none.
CORRAL_ENGINE_PREFIX = "corral_engine_"
NUM_KV_BLOCKS_FREE = "corral_engine_kv_blocks_free"
NUM_KV_BLOCKS_CACHED = "corral_engine_kv_blocks_cached"
NUM_REQUESTS_REJECTED_TOTAL = "corral_engine_requests_rejected_total"  # label: reason
NUM_STEPS_TOTAL = "corral_engine_steps_total"
STEP_DURATION_SECONDS = "corral_engine_step_duration_seconds"
# The garbage collector's passes, by generation (label `generation`; corral_engine.gc_pauses).
GC_PAUSE_SECONDS = "corral_engine_gc_pause_seconds"

# The gateway's per-model queue (label `model`): requests held for a model, woken from zero included.
# KEDA-mode autoscaling activates a model at zero replicas on it.
GATEWAY_QUEUE_LENGTH = "corral_gateway_queue_length"

# `corral fetch-model` (the init container that downloads hf:// and s3:// models): its container name
# and exit code -> the reason a status condition shows (sources/errors.py:KINDS says the same).
FETCH_CONTAINER = "fetch-model"
FETCH_EXIT_REASONS = {
    1: "FetchFailed",
    2: "InvalidModelURI",
    3: "ModelNotFound",
    4: "ModelUnauthorized",
    5: "DiskFull",
    6: "ModelCorrupt",
}

# Load headers on every engine response, so a gateway learns load from its own traffic.
HEADER_NUM_RUNNING = "x-corral-num-running"
HEADER_NUM_WAITING = "x-corral-num-waiting"
HEADER_KV_USAGE = "x-corral-kv-usage"  # 0-1 fraction
# With --enable-lora only: a short hash of the adapters served, which changes whenever one is loaded
# or unloaded, so a gateway reads the engine's /v1/models again as soon as it sees a new value.
HEADER_MODELS_VERSION = "x-corral-models-version"

# The largest request body the engine reads, and the gateway's default `max_request_bytes`: a body
# the gateway forwards is one an engine reads (OpenAI's 25 MB audio uploads, for backends that take
# them, fit). Both refuse a larger one alike: 413, code `request_too_large`.
MAX_REQUEST_BODY_BYTES = 32 << 20
CODE_REQUEST_TOO_LARGE = "request_too_large"
# The `code` of the engine's 429 when its own waiting queue is full (`--max-waiting`): a gateway
# then waits for room there or elsewhere, unlike a 429 that limits the client.
CODE_QUEUE_FULL = "rate_limit_exceeded"

# The request id: the gateway sends its own (or the client's, when valid) to the engine, which adopts
# a valid one for its response id and logs; both answer with it. Anything else is replaced, so a
# client cannot put arbitrary text into logs or headers.
HEADER_REQUEST_ID = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")

GAUGES = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC)

# The LLMDeployment custom resource (the operator serves it; the gateway patches it to wake a model).
GROUP = "corral.dev"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels the operator puts on its Services (mirrored onto their EndpointSlices) and Pods; the
# gateway discovers replicas and their LLMDeployment by them.
MODEL_LABEL = "corral.dev/model"  # value: the served model name (spec.model.name)
INSTANCE_LABEL = "app.kubernetes.io/instance"  # value: the LLMDeployment's name
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "corral-operator"
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"
# Annotation a gateway sets on an LLMDeployment (conventionally an RFC 3339 time) to wake it from zero.
WAKE_ANNOTATION = "corral.dev/wake"


def model_label_value(model: str) -> str:
    """The `corral.dev/model` label value for a served model name. Label values allow 63 characters
    of [A-Za-z0-9._-]; a name that fits is its own value (so label selectors read naturally), any
    other (`meta-llama/Llama-3.1-8B-Instruct`) becomes a readable, collision-safe stand-in. The
    gateway learns the real names from the LLMDeployments, so it never needs to invert this."""
    if _LABEL_VALUE.fullmatch(model):
        return model
    digest = hashlib.sha256(model.encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9._-]+", ".", model).strip("._-")[:52].rstrip("._-")
    return f"{readable}-{digest}" if readable else digest


def is_pod_serving(pod: Mapping[str, Any]) -> bool:
    """A pod (API JSON) takes traffic: its Ready condition is True, it has an IP, it is not being deleted."""
    status = pod.get("status") or {}
    is_ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )
    is_deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
    return is_ready and bool(status.get("podIP")) and not is_deleting


def valid_request_id(value: str | None) -> str | None:
    """`value` if it may serve as a request id (1-128 of letters, digits and `._:-`), else None."""
    if not value or len(value) > MAX_REQUEST_ID_CHARS or _REQUEST_ID.fullmatch(value) is None:
        return None
    return value
