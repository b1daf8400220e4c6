"""The engine's per-request phase histograms, tokens per step and speculative-decoding counters:
names, types, and values after a known workload (hand-made timestamps, then the tiny real model)."""

from __future__ import annotations

import pathlib

import httpx
import pytest
from corral_engine import wire
from corral_engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, StepLatencies
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import create_app
from corral_engine.server.metrics import ITERATION_TOKENS_BUCKETS, ITL_BUCKETS_S, ServerMetrics, StepHistogram
from corral_engine.settings import EngineSettings
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "m"
HISTOGRAMS = (
    wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
    wire.REQUEST_PREFILL_TIME_SECONDS,
    wire.REQUEST_DECODE_TIME_SECONDS,
    wire.REQUEST_INFERENCE_TIME_SECONDS,
    wire.ITERATION_TOKENS_TOTAL,
)
COUNTERS = (wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL, wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL)


def families(text: str) -> dict[str, tuple[str, dict[str, float]]]:
    """family name -> (type, sample name -> value) for the single model's series."""
    out: dict[str, tuple[str, dict[str, float]]] = {}
    for family in text_string_to_metric_families(text):
        values = {
            s.name + "".join(f"[{s.labels[k]}]" for k in ("le", "position") if k in s.labels): s.value
            for s in family.samples
        }
        # The parser names a counter's family without `_total`; key every family by its full name.
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = (family.type, values)
    return out


def finished(num_tokens: int, scheduled: float, first: float, last: float) -> RequestOutput:
    tokens = list(range(num_tokens))
    output = CompletionOutput(0, "x", tokens, delta_text="", delta_token_ids=[], finish_reason="length")
    metrics = RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=scheduled,
        first_token_time=first,
        last_token_time=last,
        finished_time=last,
    )
    return RequestOutput("r", [1, 2, 3], [output], finished=True, metrics=metrics)


def test_phase_histograms_after_known_requests() -> None:
    stats = EngineStats(num_spec_proposed_total=12, num_spec_accepted_total=7)
    metrics = ServerMetrics(lambda: stats, MODEL, 64)
    metrics.observe_finished(finished(5, scheduled=1.0, first=1.5, last=3.5))
    metrics.observe_finished(finished(1, scheduled=2.0, first=2.25, last=2.25))  # no decode gaps
    metrics.observe_step(0.01, 40)
    metrics.observe_step(0.01, 3)
    metrics.observe_step(0.01, 0)  # an idle step: not an iteration
    metrics.observe_step(0.02, 8, StepLatencies(ttft_s=[0.3, 0.7], itl_s=[0.02, 0.02, 0.06]))
    metrics.observe_step(0.0, 0, StepLatencies(itl_s=[0.5]))  # tokens settled after an empty schedule
    got = families(metrics.render().decode())

    for name in HISTOGRAMS:
        assert got[name][0] == "histogram", name
    for name in COUNTERS:
        assert got[name][0] == "counter", name

    _, prefill = got[wire.REQUEST_PREFILL_TIME_SECONDS]
    assert (
        prefill[wire.REQUEST_PREFILL_TIME_SECONDS + "_count"],
        prefill[wire.REQUEST_PREFILL_TIME_SECONDS + "_sum"],
    ) == (2, 0.75)
    _, decode = got[wire.REQUEST_DECODE_TIME_SECONDS]
    assert decode[wire.REQUEST_DECODE_TIME_SECONDS + "_sum"] == 2.0
    _, inference = got[wire.REQUEST_INFERENCE_TIME_SECONDS]
    assert inference[wire.REQUEST_INFERENCE_TIME_SECONDS + "_sum"] == 2.75
    _, tpot = got[wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS]
    # 2 s of decode over 4 tokens after the first; the one-token request has no time per token.
    assert tpot[wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS + "_count"] == 1
    assert tpot[wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS + "_sum"] == 0.5
    assert tpot[wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS + "_bucket[0.5]"] == 1
    assert tpot[wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS + "_bucket[0.4]"] == 0

    _, iteration = got[wire.ITERATION_TOKENS_TOTAL]
    base = wire.ITERATION_TOKENS_TOTAL
    assert iteration[base + "_count"] == 3 and iteration[base + "_sum"] == 51
    assert iteration[base + "_bucket[8.0]"] == 2 and iteration[base + "_bucket[64.0]"] == 3
    assert ITERATION_TOKENS_BUCKETS[0] == 1 and ITERATION_TOKENS_BUCKETS[-1] == 16384
    _, ttft = got[wire.TIME_TO_FIRST_TOKEN_SECONDS]
    base = wire.TIME_TO_FIRST_TOKEN_SECONDS
    assert (ttft[base + "_count"], ttft[base + "_sum"]) == (2, 1.0)
    assert (ttft[base + "_bucket[0.5]"], ttft[base + "_bucket[0.75]"]) == (1, 2)
    _, itl = got[wire.INTER_TOKEN_LATENCY_SECONDS]
    base = wire.INTER_TOKEN_LATENCY_SECONDS
    assert (itl[base + "_count"], itl[base + "_sum"]) == (4, pytest.approx(0.6))
    assert (itl[base + "_bucket[0.025]"], itl[base + "_bucket[0.075]"], itl[base + "_bucket[0.5]"]) == (
        2,
        3,
        4,
    )

    assert got[wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL][1] == {wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL: 12}
    assert got[wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL][1] == {
        wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL: 7
    }


def quantile(q: float, samples: dict[str, float], base: str) -> float:
    """Prometheus' histogram_quantile over one series' buckets (linear within a bucket)."""
    buckets = sorted(
        (float(name[len(base) + 8 : -1]), count)
        for name, count in samples.items()
        if name.startswith(base + "_bucket[")
    )
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError("rank past the +Inf bucket")


def test_short_request_phases_read_as_short() -> None:
    """A 4 ms queue wait and a 20 ms prefill are the common healthy case: their dashboard quantiles
    must not read as a tenth of a second or more (vLLM's bounds start at 0.3 s), and every one of
    vLLM's bounds is still a bucket, so queries written for a vLLM fleet read the same."""
    metrics = ServerMetrics(lambda: EngineStats(), MODEL, 64)
    out = finished(3, scheduled=0.004, first=0.024, last=0.05)
    metrics.observe_finished(out)
    got = families(metrics.render().decode())
    for name, most_s in (
        (wire.REQUEST_QUEUE_TIME_SECONDS, 0.005),
        (wire.REQUEST_PREFILL_TIME_SECONDS, 0.025),
        (wire.E2E_REQUEST_LATENCY_SECONDS, 0.05),
    ):
        _, samples = got[name]
        for q in (0.5, 0.99):
            assert quantile(q, samples, name) <= most_s, (name, q)
        for bound in (0.3, 0.5, 0.8, 7680.0):
            assert f"{name}_bucket[{bound}]" in samples, (name, bound)


def test_step_histogram_reads_as_prometheus_clients_histogram() -> None:
    """The token-latency histograms are observed a step at a time; their exposition (bucket
    bounds, counts, sum) is what prometheus_client's Histogram gives for the same values, values on
    a bound included (a bucket's bound is inclusive)."""
    values = [0.0, 0.01, 0.0100001, 0.025, 0.3, 0.31, 79.9, 80.0, 80.5, 1e9, 0.02, 0.02]
    reference_registry = CollectorRegistry()
    reference = Histogram(
        "h", "doc", [wire.MODEL_NAME_LABEL], buckets=ITL_BUCKETS_S, registry=reference_registry
    )
    for value in values:
        reference.labels(MODEL).observe(value)
    ours_registry = CollectorRegistry()
    ours = StepHistogram("h", "doc", ITL_BUCKETS_S, MODEL)
    ours_registry.register(ours)
    ours.observe_many(values[:5])
    ours.observe_many([])
    ours.observe_many(values[5:])

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        text = generate_latest(registry).decode()
        return {
            (s.name, s.labels.get("le", "")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if not s.name.endswith("_created")
        }

    got, expected = samples(ours_registry), samples(reference_registry)
    assert got.pop(("h_sum", "")) == pytest.approx(expected.pop(("h_sum", "")))  # added in another order
    assert got == expected and got[("h_count", "")] == len(values)


def test_aborted_requests_are_not_observed() -> None:
    metrics = ServerMetrics(EngineStats, MODEL, 64)
    out = finished(5, scheduled=1.0, first=1.5, last=3.5)
    out.outputs[0].finish_reason = "abort"
    metrics.observe_finished(out)
    got = families(metrics.render().decode())
    assert got[wire.REQUEST_DECODE_TIME_SECONDS][1][wire.REQUEST_DECODE_TIME_SECONDS + "_count"] == 0


@pytest.mark.parametrize("speculative", [None, "ngram"])
async def test_served_tiny_model_metrics(
    tiny_model_dir: pathlib.Path, speculative: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral_engine import AsyncEngine, EngineArgs, token_appender

    # A random-weight model rarely repeats itself: propose 4 drafts every step (accepted only
    # where the model happens to agree), so the draft count is known.
    monkeypatch.setattr(token_appender.ngram, "propose", lambda ids, k, **_: [(ids[-1] + 1) % 500] * k)

    args = EngineArgs(
        model=str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        speculative=speculative,
        served_model_name="tiny",
    )
    engine = AsyncEngine(args)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            # A repetitive prompt, so n-gram drafts find matches.
            body = {
                "model": "tiny",
                "prompt": [5, 6, 7, 8] * 8,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got = families((await client.get("/metrics")).text)
            stats = engine.stats()

    for name in (
        wire.REQUEST_PREFILL_TIME_SECONDS,
        wire.REQUEST_DECODE_TIME_SECONDS,
        wire.REQUEST_INFERENCE_TIME_SECONDS,
        wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
    ):
        assert got[name][1][name + "_count"] == 1, name
    phases = {
        n: got[n][1][n + "_sum"]
        for n in (wire.REQUEST_PREFILL_TIME_SECONDS, wire.REQUEST_DECODE_TIME_SECONDS)
    }
    inference = got[wire.REQUEST_INFERENCE_TIME_SECONDS][1][wire.REQUEST_INFERENCE_TIME_SECONDS + "_sum"]
    assert inference == pytest.approx(sum(phases.values()))
    tpot = got[wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS][1][
        wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS + "_sum"
    ]
    assert tpot == pytest.approx(phases[wire.REQUEST_DECODE_TIME_SECONDS] / 23)
    # A non-streamed request has one output, at its end; the token latencies come from its steps:
    # one time to first token, and a gap for each of the 23 tokens after it (drafts accepted
    # together split their step's), adding up to the decode time.
    itl = got[wire.INTER_TOKEN_LATENCY_SECONDS][1]
    assert got[wire.TIME_TO_FIRST_TOKEN_SECONDS][1][wire.TIME_TO_FIRST_TOKEN_SECONDS + "_count"] == 1
    assert itl[wire.INTER_TOKEN_LATENCY_SECONDS + "_count"] == 23
    assert itl[wire.INTER_TOKEN_LATENCY_SECONDS + "_sum"] == pytest.approx(
        phases[wire.REQUEST_DECODE_TIME_SECONDS]
    )

    base = wire.ITERATION_TOKENS_TOTAL
    iteration = got[base][1]
    assert 1 <= iteration[base + "_count"] <= stats.num_steps_total
    drafts = got[wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL][1][wire.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL]
    accepted = got[wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL][1][wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL]
    assert (drafts, accepted) == (stats.num_spec_proposed_total, stats.num_spec_accepted_total)
    num_drafts = got[wire.SPEC_DECODE_NUM_DRAFTS_TOTAL][1][wire.SPEC_DECODE_NUM_DRAFTS_TOTAL]
    assert num_drafts == stats.num_spec_drafts_total
    per_pos_name = wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL
    if speculative is None:
        assert drafts == accepted == num_drafts == 0
        assert per_pos_name not in got  # as vLLM: no positions without speculative decoding
        # The prompt's 32 tokens, then one fed-back token per decode step for the 23 after the first.
        assert iteration[base + "_sum"] == 32 + 23
        assert iteration[base + "_count"] == 24
    else:
        assert drafts > 0 and 0 <= accepted <= drafts
        # A draft holds 1-4 tokens (fewer as max_tokens nears); a position's acceptances never
        # exceed the one before it's, and they add up to the accepted tokens.
        assert num_drafts <= drafts <= 4 * num_drafts
        per_pos = [got[per_pos_name][1][f"{per_pos_name}[{p}]"] for p in range(4)]
        assert num_drafts >= per_pos[0] >= per_pos[1] >= per_pos[2] >= per_pos[3]
        assert sum(per_pos) == accepted and per_pos == stats.num_spec_accepted_per_pos
        # Each step verifies 4 drafts and yields at least one token: at most 24 steps.
        assert iteration[base + "_count"] <= 24


def test_the_serving_process_reports_its_own_memory_as_vllms_does() -> None:
    metrics = ServerMetrics(lambda: EngineStats(), "m", 128)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert (metrics.registry.get_sample_value(name) or 0) > 0, name


def test_each_sequence_of_a_request_is_observed_as_a_request() -> None:
    """n > 1: each sequence is a child request with its own token times and end (vLLM v1); an
    aborted one is left out, as a whole aborted request is."""
    metrics = ServerMetrics(EngineStats, MODEL, 64)
    times = RequestMetrics.for_sequences(0.0, 2)
    assert times.children is not None
    times.first_scheduled_time = 1.0
    times.children[0].first_token_time, times.children[0].last_token_time = 1.5, 2.5
    times.children[1].first_token_time, times.children[1].last_token_time = 2.0, 2.5
    times.children[0].finished_time = 2.5
    times.finish(3.0)
    outputs = [CompletionOutput(i, "x", [1] * (3 - i), "", [], finish_reason="length") for i in range(2)]
    metrics.observe_finished(RequestOutput("r", [1, 2, 3], outputs, finished=True, metrics=times))
    outputs[1].finish_reason = "abort"
    metrics.observe_finished(RequestOutput("r2", [1, 2, 3], outputs, finished=True, metrics=times))
    got = families(metrics.render().decode())

    def count_sum(name: str) -> tuple[float, float]:
        return got[name][1][name + "_count"], got[name][1][name + "_sum"]

    assert count_sum(wire.E2E_REQUEST_LATENCY_SECONDS) == (3, 2.5 + 3.0 + 2.5)
    assert count_sum(wire.REQUEST_QUEUE_TIME_SECONDS) == (3, 3.0)
    assert count_sum(wire.REQUEST_PROMPT_TOKENS) == (3, 9)
    assert count_sum(wire.REQUEST_GENERATION_TOKENS) == (3, 3 + 2 + 3)
    assert count_sum(wire.REQUEST_PREFILL_TIME_SECONDS) == (3, 0.5 + 1.0 + 0.5)
    assert count_sum(wire.REQUEST_DECODE_TIME_SECONDS) == (3, 1.0 + 0.5 + 1.0)
    assert count_sum(wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS) == (3, 0.5 + 0.5 + 0.5)


def _request_samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, its `finished_reason` or `le` label) -> value, for the single model's series."""
    return {
        (s.name, s.labels.get("finished_reason", s.labels.get("le", ""))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("engine_process", ["0", "1"])
async def test_request_counts_agree_for_n_1_and_n_3(
    tiny_model_dir: pathlib.Path, engine_process: str
) -> None:
    """vllm:request_success_total and the per-request histograms count the same requests: an n=3
    request counts as three (vLLM v1's child requests), in one process or with the engine core in
    its own."""
    from corral_engine import AsyncEngine, EngineArgs, EngineCoreClient

    args = EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, served_model_name="tiny")
    settings = EngineSettings(engine_process=engine_process)  # type: ignore[arg-type]
    engine = EngineCoreClient(args, settings=settings) if engine_process == "1" else AsyncEngine(args)
    prompt = [5, 6, 7, 8, 9]
    per_request = (
        wire.E2E_REQUEST_LATENCY_SECONDS,
        wire.TIME_TO_FIRST_TOKEN_SECONDS,
        wire.REQUEST_QUEUE_TIME_SECONDS,
        wire.REQUEST_PROMPT_TOKENS,
        wire.REQUEST_GENERATION_TOKENS,
        wire.REQUEST_PREFILL_TIME_SECONDS,
        wire.REQUEST_DECODE_TIME_SECONDS,
        wire.REQUEST_INFERENCE_TIME_SECONDS,
        wire.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
    )
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            before = _request_samples((await client.get("/metrics")).text)
            for n in (1, 3):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "n": n, "ignore_eos": True}
                r = await client.post("/v1/completions", json=body | {"temperature": 1.0, "seed": n})
                assert r.status_code == 200, r.text
                after = _request_samples((await client.get("/metrics")).text)
                delta = {key: after[key] - before.get(key, 0.0) for key in after}
                before = after
                assert delta[(wire.REQUEST_SUCCESS_TOTAL, "length")] == n
                for name in per_request:
                    assert delta[(name + "_count", "")] == n, name
                assert delta[(wire.REQUEST_PROMPT_TOKENS + "_sum", "")] == n * len(prompt)
                assert delta[(wire.PROMPT_TOKENS_TOTAL, "")] == n * len(prompt)
                assert delta[(wire.REQUEST_GENERATION_TOKENS + "_sum", "")] == n * 4
                assert delta[(wire.GENERATION_TOKENS_TOTAL, "")] == n * 4
                assert delta[(wire.INTER_TOKEN_LATENCY_SECONDS + "_count", "")] == n * 3


def test_request_parameter_histograms_as_vllm_records_them() -> None:
    """vllm:request_params_max_tokens and vllm:request_prefill_kv_computed_tokens per sequence (a
    child request in vLLM; the sequences share one prefill, so only the first computed it), and
    vllm:request_params_n and vllm:request_max_num_generation_tokens once per request; a request
    without max_tokens counts the room its context left, as vLLM's default does."""
    metrics = ServerMetrics(EngineStats, MODEL, 64)
    times = RequestMetrics.for_sequences(0.0, 3)
    times.num_cached_tokens = 4  # of a 10-token prompt
    times.finish(1.0)
    outputs = [CompletionOutput(i, "x", [1] * (2 + i), "", [], finish_reason="length") for i in range(3)]
    prompt = list(range(10))
    metrics.observe_finished(
        RequestOutput("r", prompt, outputs, True, times), SamplingParams(n=3, max_tokens=8)
    )
    single = finished(5, scheduled=1.0, first=1.5, last=3.5)  # a 3-token prompt, nothing cached
    metrics.observe_finished(single, SamplingParams(max_tokens=None))
    aborted = finished(2, scheduled=1.0, first=1.5, last=2.0)
    aborted.outputs[0].finish_reason = "abort"
    metrics.observe_finished(aborted, SamplingParams(max_tokens=9))
    got = families(metrics.render().decode())

    def count_sum(name: str) -> tuple[float, float]:
        assert got[name][0] == "histogram", name
        return got[name][1][name + "_count"], got[name][1][name + "_sum"]

    assert count_sum(wire.REQUEST_PARAMS_MAX_TOKENS) == (4, 3 * 8 + (64 - 3))
    assert count_sum(wire.REQUEST_PREFILL_KV_COMPUTED_TOKENS) == (4, (10 - 4) + 0 + 0 + 3)
    assert count_sum(wire.REQUEST_PARAMS_N) == (2, 3 + 1)
    assert count_sum(wire.REQUEST_MAX_NUM_GENERATION_TOKENS) == (2, 4 + 5)
    n = got[wire.REQUEST_PARAMS_N][1]
    assert [k[len(wire.REQUEST_PARAMS_N + "_bucket") :] for k in n if "_bucket" in k] == [
        "[1.0]",
        "[2.0]",
        "[5.0]",
        "[10.0]",
        "[20.0]",
        "[+Inf]",
    ]
    assert (n[wire.REQUEST_PARAMS_N + "_bucket[2.0]"], n[wire.REQUEST_PARAMS_N + "_bucket[5.0]"]) == (1, 2)
    # Token-count bounds are vLLM's 1-2-5 series up to max_model_len.
    bounds = [k for k in got[wire.REQUEST_PARAMS_MAX_TOKENS][1] if "_bucket" in k]
    assert bounds[-2:] == [
        wire.REQUEST_PARAMS_MAX_TOKENS + "_bucket[50.0]",
        wire.REQUEST_PARAMS_MAX_TOKENS + "_bucket[+Inf]",
    ]


def test_every_vllm_series_carries_vllms_labels() -> None:
    """vLLM labels each of its series model_name and engine (the engine core's index): a query or
    recording rule written for a vLLM fleet (`sum by (model_name, engine)`) reads a Corral engine
    alike. Corral's own series keep model_name alone."""
    stats = EngineStats(num_spec_accepted_per_pos=[3, 1])
    text = ServerMetrics(lambda: stats, MODEL, 64).render().decode()
    vllm_samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:")
    ]
    names = {s.name for s in vllm_samples}
    for name in (
        wire.NUM_REQUESTS_RUNNING,
        wire.CACHE_CONFIG_INFO,
        wire.REQUEST_SUCCESS_TOTAL,
        wire.TIME_TO_FIRST_TOKEN_SECONDS + "_count",
        wire.E2E_REQUEST_LATENCY_SECONDS + "_count",
        wire.SPEC_DECODE_NUM_DRAFTS_TOTAL,
        wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL,
    ):
        assert name in names, name
    for s in vllm_samples:
        assert (s.labels.get(wire.MODEL_NAME_LABEL), s.labels.get(wire.ENGINE_LABEL)) == (MODEL, "0"), s
    per_pos = {
        s.labels["position"]: s.value
        for s in vllm_samples
        if s.name == wire.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL
    }
    assert per_pos == {"0": 3, "1": 1}
    assert f'{wire.NUM_STEPS_TOTAL}{{model_name="{MODEL}"}} 0.0' in text
