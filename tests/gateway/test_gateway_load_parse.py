"""Reading replica load from /metrics text (Corral and vLLM) and from response headers."""

from __future__ import annotations

from corral_engine import wire
from corral_gateway.load import parse_load_headers, parse_metrics_text

# Shaped like vLLM v1's exposition (histogram lines included, two model labels).
VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="0",model_name="b"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.5
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="a"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="a"} 0.0
"""


def test_parses_vllm_names_summing_running_and_waiting() -> None:
    sample = parse_metrics_text(VLLM_TEXT, at_s=5.0)
    assert sample is not None
    assert (sample.num_running, sample.num_waiting, sample.kv_usage_ratio, sample.at_s) == (4, 2, 0.5, 5.0)


def test_reads_legacy_gpu_cache_usage_name() -> None:
    text = VLLM_TEXT.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    sample = parse_metrics_text(text, at_s=1.0)
    assert sample is not None and sample.kv_usage_ratio == 0.5


def test_missing_or_garbage_metrics_give_none() -> None:
    assert parse_metrics_text("# nothing here\nother_metric 1\n", at_s=0.0) is None
    assert parse_metrics_text("vllm:num_requests_running{model_name= 1 2 3\n", at_s=0.0) is None


def test_load_headers() -> None:
    headers = {wire.HEADER_NUM_RUNNING: "3", wire.HEADER_NUM_WAITING: "7", wire.HEADER_KV_USAGE: "0.42"}
    sample = parse_load_headers(headers, at_s=2.0)
    assert sample is not None and (sample.num_running, sample.num_waiting, sample.kv_usage_ratio) == (
        3,
        7,
        0.42,
    )
    assert parse_load_headers({}, at_s=2.0) is None
    assert parse_load_headers({**headers, wire.HEADER_NUM_RUNNING: "lots"}, at_s=2.0) is None
