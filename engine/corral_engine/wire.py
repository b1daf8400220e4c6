"""The engine's wire contract (light; no torch): metric names and load headers.

Gateways, dashboards and tests import these names instead of spelling them; the metric names
and meanings are vLLM's, so routers and dashboards built for vLLM read a Corral engine unchanged.
"""

from __future__ import annotations

# Label carried by every engine metric.
MODEL_NAME_LABEL = "model_name"

# Gauges.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # a 0-1 fraction, despite the name
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # labels: block_size, num_gpu_blocks

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

# Corral-specific metrics where vLLM has none.
CORRAL_ENGINE_PREFIX = "corral_engine_"
NUM_KV_BLOCKS_FREE = "corral_engine_kv_blocks_free"
NUM_KV_BLOCKS_CACHED = "corral_engine_kv_blocks_cached"
NUM_REQUESTS_REJECTED_TOTAL = "corral_engine_requests_rejected_total"  # label: reason
NUM_STEPS_TOTAL = "corral_engine_steps_total"
STEP_DURATION_SECONDS = "corral_engine_step_duration_seconds"

# Load headers on every engine response, so a gateway learns load from its own traffic.
HEADER_NUM_RUNNING = "x-corral-num-running"
HEADER_NUM_WAITING = "x-corral-num-waiting"
HEADER_KV_USAGE = "x-corral-kv-usage"  # 0-1 fraction

GAUGES = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC)
