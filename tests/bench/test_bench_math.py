"""Pure parts of `corral bench`: arrivals, workload sampling, aggregation, /metrics parsing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from corral_cli.bench import prom, report, workload
from corral_cli.bench.arrivals import arrival_offsets_s, parse_rates
from corral_cli.bench.client import RequestSettings, build_body
from corral_cli.bench.stats import RequestResult, aggregate, summarize
from corral_cli.bench.workload import BenchRequest
from corral_cli.bench.workload import LengthSpec as Spec


class CharTokenizer:
    """One token per character; ids are code points, 0-2 are specials."""

    vocab_size = 300
    special_ids = frozenset({0, 1, 2})

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_parse_rates():
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "fast", "", "nan", "1,,2", "1,2,", " , "):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets_s(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert arrival_offsets_s(0, 1.0, 1.0, seed=0) == []


def test_poisson_arrivals_have_the_requested_mean_rate_and_are_seeded():
    offsets = arrival_offsets_s(20_001, 4.0, 1.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert offsets == arrival_offsets_s(20_001, 4.0, 1.0, seed=3)
    assert offsets != arrival_offsets_s(20_001, 4.0, 1.0, seed=4)


def test_burstiness_changes_spread_not_mean():
    bursty = np.diff(arrival_offsets_s(20_001, 4.0, 0.25, seed=0))
    regular = np.diff(arrival_offsets_s(20_001, 4.0, 16.0, seed=0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.08)
    assert regular.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert regular.std() / regular.mean() == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        arrival_offsets_s(3, 1.0, 0.0, seed=0)


def test_random_prompts_have_exact_lengths_in_range_and_skip_specials():
    ids = workload.allowed_token_ids(CharTokenizer(), None)
    assert not set(ids.tolist()) & {0, 1, 2} and len(ids) == 297
    reqs = workload.sample_random(200, Spec(100, 50, 0.5), seed=1, token_ids=ids)
    assert len(reqs) == 200
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 50 <= r.prompt_len <= 150 and 25 <= r.output_len <= 75
        assert set(r.prompt) <= set(ids.tolist())
    assert len({r.prompt_len for r in reqs}) > 20
    assert reqs == workload.sample_random(200, Spec(100, 50, 0.5), seed=1, token_ids=ids)
    exact = workload.sample_random(10, Spec(32, 8, 0.0), seed=1, token_ids=ids)
    assert {(r.prompt_len, r.output_len) for r in exact} == {(32, 8)}


def test_random_variants_keep_lengths_and_change_prompts():
    ids = workload.allowed_token_ids(None, 1000)
    a = workload.sample_random(20, Spec(64, 16, 0.5), seed=2, token_ids=ids, variant=0)
    b = workload.sample_random(20, Spec(64, 16, 0.5), seed=2, token_ids=ids, variant=1)
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, b, strict=True))
    ta = workload.random_text_prompts(5, Spec(30, 4, 0.5), seed=2, variant=0)
    tb = workload.random_text_prompts(5, Spec(30, 4, 0.5), seed=2, variant=1)
    assert [r.prompt_len for r in ta] == [r.prompt_len for r in tb] and ta != tb


def test_lognormal_lengths_have_the_median_and_stay_clipped():
    spec = Spec(150, 120, dist="lognormal", sigma=0.8, min_len=8, max_input_len=1024, max_output_len=512)
    in_lens, out_lens = workload.sample_lengths(spec, 4000, seed=0)
    assert np.median(in_lens) == pytest.approx(150, rel=0.06)
    assert np.median(out_lens) == pytest.approx(120, rel=0.06)
    assert min(in_lens) >= 8 and max(in_lens) == 1024  # the long tail reaches the clip
    assert min(out_lens) >= 8 and max(out_lens) == 512
    assert (in_lens, out_lens) == workload.sample_lengths(spec, 4000, seed=0)
    reqs = workload.sample_random(50, spec, 0, np.arange(3, 259))
    assert [r.prompt_len for r in reqs] == [len(r.prompt) for r in reqs] == in_lens[:50]
    for bad in (Spec(10, 10, dist="zipf"), Spec(10, 10, dist="lognormal", sigma=0)):
        with pytest.raises(ValueError):
            workload.sample_lengths(bad, 3, seed=0)


def test_random_token_ids_without_tokenizer_stay_in_a_safe_range():
    ids = workload.allowed_token_ids(None, None)
    assert ids.min() >= 3 and ids.max() < 259
    assert workload.allowed_token_ids(None, 1000).max() == 999
    with pytest.raises(ValueError):
        workload.allowed_token_ids(None, 2)


def test_random_prompts_as_text_for_chat():
    letters = np.arange(97, 123)
    reqs = workload.sample_random(5, Spec(10, 4, 0.0), seed=0, token_ids=letters, as_text=CharTokenizer())
    assert all(isinstance(r.prompt, str) and len(r.prompt) == 10 == r.prompt_len for r in reqs)
    words = workload.random_text_prompts(3, Spec(12, 4, 0.0), seed=0)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in words)


def test_chat_prompts_without_a_tokenizer_have_the_asked_length_in_a_small_vocabulary(
    tiny_model_dir: Path,
) -> None:
    """The demo model's 1,024-entry vocabulary is the hard case: its merges cover few whole words."""
    tokenizer = workload.HFTokenizer(tiny_model_dir)
    requests = workload.random_text_prompts(8, Spec(64, 4, 0.5), seed=3)
    assert [len(tokenizer.encode(str(r.prompt))) for r in requests] == [r.prompt_len for r in requests]


def test_length_range_validation():
    assert workload.length_range(100, 0.0) == (100, 100)
    assert workload.length_range(1, 0.9) == (1, 2)
    for args in ((0, 0.0), (10, 1.0), (10, -0.1)):
        with pytest.raises(ValueError):
            workload.length_range(*args)


def _conv(prompt: str, reply: str) -> dict:
    return {"id": "x", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


def test_sharegpt_uses_first_turn_and_reply_length_and_filters():
    entries = [
        _conv("hello there", "a reply of some length"),
        _conv("hi", "too short a prompt"),  # prompt < 4 tokens
        _conv("a long enough prompt", "ok"),  # reply < 4 tokens
        _conv("x" * 50, "y" * 10),  # prompt > max_prompt_len
        {"id": "lonely", "conversations": [{"from": "human", "value": "no reply here"}]},
        "garbage",
    ]
    reqs = workload.parse_sharegpt(entries, CharTokenizer(), max_prompt_len=40, max_total_len=100)
    assert reqs == [BenchRequest("hello there", 11, 22)]


def test_jsonl_records():
    tok = CharTokenizer()
    parse = workload.parse_jsonl_record
    assert parse({"prompt": "abc", "output_len": 5}, tok, 1) == BenchRequest("abc", 3, 5)
    assert parse({"prompt_token_ids": [5, 6], "max_tokens": 2}, None, 1) == BenchRequest([5, 6], 2, 2)
    fmt = {"response_format": {"type": "json_object"}}
    assert parse({"prompt": [1], "output_len": 2, "extra_body": fmt}, None, 1) == BenchRequest([1], 1, 2, fmt)
    bad_records = ({"prompt": "", "output_len": 1}, {"prompt": "a", "output_len": 0}, {"prompt": [-1]}, [1])
    for bad in (*bad_records, {"prompt": "a", "output_len": 1, "extra_body": [1]}):
        with pytest.raises(ValueError, match="line 7"):
            workload.parse_jsonl_record(bad, tok, 7)


def test_load_dataset_formats_and_errors(tmp_path):
    share = tmp_path / "share.json"
    share.write_text(json.dumps([_conv(f"prompt number {i}", "reply text " * (i + 2)) for i in range(10)]))
    reqs = workload.load_dataset(share, 4, seed=0, tokenizer=CharTokenizer())
    assert len(reqs) == 4 and len({r.prompt for r in reqs}) == 4
    assert reqs == workload.load_dataset(share, 4, seed=0, tokenizer=CharTokenizer())
    assert len(workload.load_dataset(share, 50, seed=0, tokenizer=None)) == 10

    lines = tmp_path / "data.jsonl"
    lines.write_text('{"prompt": [1, 2, 3], "output_len": 4}\n\n{"prompt": "text", "output_len": 2}\n')
    assert sorted(r.output_len for r in workload.load_dataset(lines, 10, 0, None)) == [2, 4]

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "output_len": 1}\n{nope\n')
    with pytest.raises(ValueError, match="line 2"):
        workload.load_dataset(tmp_path / "bad.jsonl", 1, 0, None)
    with pytest.raises(ValueError, match="cannot read"):
        workload.load_dataset(tmp_path / "missing.json", 1, 0, None)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no usable"):
        workload.load_dataset(tmp_path / "empty.json", 1, 0, None)


def test_summarize_percentiles_in_ms():
    stats = summarize([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in summarize([]).values())


def test_aggregate_counts_throughput_and_latencies():
    ok = RequestResult(True, prompt_len=10, output_len=5, ttft_s=0.1, e2el_s=0.5, itl_s=[0.1] * 4)
    ok2 = RequestResult(True, prompt_len=20, output_len=1, ttft_s=0.3, e2el_s=0.3)
    bad = RequestResult(False, prompt_len=99, error="HTTP 400: nope")
    s = aggregate([ok, ok2, bad], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 6)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(18.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)  # only ok has >= 2 tokens: (0.5 - 0.1) / 4
    assert s["p99_itl_ms"] == pytest.approx(100.0)
    assert s["median_e2el_ms"] == pytest.approx(400.0)
    assert s["errors"] == {"HTTP 400: nope": 1}


METRICS = """# HELP vllm:num_preemptions_total Cumulative preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="a",engine="0"} 3.0
vllm:num_preemptions_total{model_name="b x {}"} 4
vllm:num_preemptions_created{model_name="a"} 1.7e9
vllm:num_requests_running{model_name="a"} 9
other_metric 1
"""


def test_prometheus_counter_sum():
    assert prom.sum_samples(METRICS, "vllm:num_preemptions_total") == 7.0
    assert prom.sum_samples(METRICS, "vllm:num_preemptions") == 7.0
    assert prom.sum_samples(METRICS, "other_metric") == 1.0
    assert prom.sum_samples(METRICS, "vllm:missing_total") is None
    assert prom.sum_samples("vllm:num_preemptions 2 1700000000\n", "vllm:num_preemptions_total") == 2.0
    assert prom.delta(3.0, 10.0) == 7.0
    assert prom.delta(None, 1.0) is None and prom.delta(5.0, 1.0) is None


def test_result_file_is_strict_json(tmp_path):
    summary = aggregate([RequestResult(False, error="x")], duration_s=1.0)
    summary["request_rate"] = math.inf
    report.write_result_file(tmp_path / "r.json", {"seed": 0}, [summary])
    doc = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    (run,) = doc["runs"]
    assert run["request_rate"] == "inf" and run["mean_ttft_ms"] is None and run["failed"] == 1


def test_request_fields_win_over_the_runs_extra_body():
    settings = RequestSettings("http://127.0.0.1:1", "m", extra_body={"top_p": 0.5, "seed": 1})
    schema = {"response_format": {"type": "json_object"}, "seed": 7}
    body = build_body(settings, BenchRequest([1, 2], 2, 3, schema))
    assert body["response_format"] == {"type": "json_object"} and body["seed"] == 7 and body["top_p"] == 0.5
    assert "response_format" not in build_body(settings, BenchRequest([1, 2], 2, 3))
