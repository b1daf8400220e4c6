"""The triton attention backend in the engine, on CPU through Triton's interpreter: backend choice,
greedy equality with transformers (eager, and through captured decode graphs replayed over their
persistent buffers), and the GPU-memory arithmetic that sizes the KV cache on CUDA.

The kernels themselves are checked against a reference in test_triton_attention.py. CUDA graphs
proper (torch.cuda.CUDAGraph) need a GPU: bench/gpu/acceptance.py exercises them there; here
EagerCapture replays by running the captured pass again over the same buffers.
"""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Mapping

import pytest
from corral_engine.errors import ModelLoadError
from corral_engine.model import runner as runner_module
from corral_engine.model.attention import choose_attention_backend
from corral_engine.model.cuda_graphs import EagerCapture, capture_sizes
from corral_engine.model.kv_cache import (
    GpuMemoryProfile,
    gpu_kv_cache_bytes,
    profile_gpu_memory,
    used_outside_torch,
)
from corral_engine.model.sampler import sample_rows
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

from tests.engine.helpers import make_engine, random_prompts, run_checked, transformers_greedy

INTERPRET = EngineSettings(triton_interpret=True)
MAX_NEW = 8


@pytest.mark.parametrize(
    ("requested", "device", "has_native", "interpret", "chosen"),
    [
        ("auto", "cuda", False, False, "triton"),
        ("auto", "cpu", True, False, "native"),
        ("auto", "cpu", False, False, "sdpa"),
        ("auto", "cpu", True, True, "native"),  # the interpreter is for tests, never chosen by auto
        ("triton", "cpu", True, True, "triton"),
        ("triton", "cuda", False, False, "triton"),
        ("sdpa", "cuda", False, False, "sdpa"),
        ("native", "cpu", True, False, "native"),
    ],
)
def test_backend_choice(requested: str, device: str, has_native: bool, interpret: bool, chosen: str) -> None:
    assert choose_attention_backend(requested, device, has_native, interpret) == chosen


@pytest.mark.parametrize(
    ("requested", "device", "has_native", "why"),
    [
        ("triton", "cpu", True, "TRITON_INTERPRET=1"),
        ("native", "cuda", False, "CPU kernel"),
        ("native", "cpu", False, "did not build"),
    ],
)
def test_a_backend_that_cannot_run_here_says_why(
    requested: str, device: str, has_native: bool, why: str
) -> None:
    with pytest.raises(ModelLoadError, match=why):
        choose_attention_backend(requested, device, has_native, False)


def test_the_engine_refuses_triton_on_cpu_without_the_interpreter(tiny_model_dir: pathlib.Path) -> None:
    with pytest.raises(ModelLoadError, match="TRITON_INTERPRET"):
        make_engine(tiny_model_dir, EngineSettings(triton_interpret=False), attention_backend="triton")


def test_capture_sizes_pad_a_batch_by_at_most_seven() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = capture_sizes(100)
    assert sizes[-1] == 100 and all(b - a <= 8 for a, b in itertools.pairwise(sizes))


def _generate(engine, prompts: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    final = run_checked(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]


# gemma2: its attention soft-capping inside the kernel (a constexpr the other archs compile without)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma3", "granite", "olmo2", "gemma2"])
def test_eager_triton_matches_transformers(arch: str, tiny_model_dirs: Mapping[str, pathlib.Path]) -> None:
    """Chunked prompts (budget 16 tokens), decodes and prefix-cache hits (a shared 24-token head
    in blocks of 8) in mixed batches, all through the one Triton launch per layer."""
    model_dir = tiny_model_dirs[arch]
    shared = random_prompts(1, 500, seed=11, min_len=24, max_len=24)[0]
    prompts = [shared + tail for tail in random_prompts(3, 500, seed=12, min_len=1, max_len=20)]
    prompts += random_prompts(2, 500, seed=13, min_len=3, max_len=30)
    expected = transformers_greedy(model_dir, prompts, MAX_NEW)
    engine = make_engine(
        model_dir,
        INTERPRET,
        attention_backend="triton",
        enforce_eager=True,
        block_size=8,
        max_num_batched_tokens=16,
    )
    assert engine.runner.attention_backend == "triton" and engine.runner.graphs is None
    assert _generate(engine, prompts) == expected
    assert engine.stats().num_prefix_cache_hits_total > 0


@pytest.mark.parametrize(
    ("arch", "backend"),
    [("llama", "triton"), ("qwen3", "triton"), ("llama", "sdpa"), ("gemma3", "triton"), ("olmo2", "triton")],
)
def test_fused_elementwise_kernels_keep_transformers_output(
    arch: str, backend: str, tiny_model_dirs: Mapping[str, pathlib.Path]
) -> None:
    """CORRAL_TRITON_OPS=1 (auto turns it on for CUDA): residual add + RMSNorm, rotary (in place on
    the QKV rows; qwen3's per-head q/k norms first) and SiLU-and-multiply as Triton kernels, with
    the triton attention backend and with SDPA, through chunked prompts and decodes."""
    model_dir = tiny_model_dirs[arch]
    prompts = random_prompts(4, 500, seed=31, min_len=3, max_len=30)
    expected = transformers_greedy(model_dir, prompts, MAX_NEW)
    settings = EngineSettings(triton_interpret=True, triton_ops="1")
    engine = make_engine(
        model_dir, settings, attention_backend=backend, enforce_eager=True, max_num_batched_tokens=16
    )
    layer = engine.runner.model.model.layers[0]
    assert layer.mlp.triton_ops is not None and layer.self_attn.triton_ops is not None
    assert _generate(engine, prompts) == expected


def test_the_rotary_kernel_rotates_a_partial_rotary_heads_leading_dims(tmp_path: pathlib.Path) -> None:
    """Phi-4-mini's partial rotary (12 of the tiny Phi-3's 16 dims): the Triton rotary runs in
    place on views of each head's leading dims, leaving the rest as projected."""
    from corral_engine.demo_model import write_demo_model

    overrides = {"partial_rotary_factor": 0.75}
    model_dir = write_demo_model(tmp_path / "m", arch="phi3", config_overrides=overrides)
    prompts = random_prompts(4, 500, seed=32, min_len=3, max_len=30)
    expected = transformers_greedy(model_dir, prompts, MAX_NEW)
    settings = EngineSettings(triton_interpret=True, triton_ops="1")
    engine = make_engine(
        model_dir, settings, attention_backend="triton", enforce_eager=True, max_num_batched_tokens=16
    )
    assert engine.runner.model.model.layers[0].self_attn.triton_ops is not None
    assert _generate(engine, prompts) == expected


def test_fused_elementwise_kernels_are_off_on_cpu_by_default(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, INTERPRET, attention_backend="triton", enforce_eager=True)
    assert engine.runner.model.model.norm.triton_ops is None


# gemma3: per-layer windows and rotary in graphs; gemma2: soft-capped scores in them
@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gemma2"])
def test_decode_graphs_replay_padded_batches_with_transformers_output(
    arch: str, tiny_model_dirs: Mapping[str, pathlib.Path]
) -> None:
    """max_num_seqs 4: graphs for 1, 2 and 4 sequences; 5 requests keep the running batch at 4,
    3, 2 and 1 as they finish at different times, so 3 pads to 4 (a padding row with no KV slot
    and a padding sequence with no context), and a preempting small cache rewrites block tables."""
    model_dir = tiny_model_dirs[arch]
    prompts = random_prompts(5, 500, seed=21, min_len=2, max_len=30)
    expected = transformers_greedy(model_dir, prompts, MAX_NEW)
    capture = EagerCapture()
    engine = make_engine(
        model_dir,
        INTERPRET,
        graph_capture=capture,
        attention_backend="triton",
        block_size=8,
        max_num_seqs=4,
        num_kv_blocks=12,
    )
    assert capture.captured == [4, 2, 1]  # largest first
    params = [SamplingParams(max_tokens=MAX_NEW - i, temperature=0.0, ignore_eos=True) for i in range(4)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i % 4])
    final = run_checked(engine)
    for i in range(len(prompts)):
        assert final[f"r{i}"] == expected[i][: MAX_NEW - i % 4]
    assert {4, 2, 1} <= set(capture.replayed)
    assert engine.stats().num_preemptions_total > 0


class FakeCudaMemory:
    """The card: 80 GiB, 1 GiB held by the CUDA context and `others_gib` by other processes; the
    profiled step allocates 20 GiB of weights and activations at its peak."""

    GIB = 1 << 30

    def __init__(self, others_gib: int = 0) -> None:
        self.reserved = 0
        self.peak = 0
        self.others = others_gib * self.GIB
        self.calls: list[str] = []

    def mem_get_info(self) -> tuple[int, int]:
        total = 80 * self.GIB
        return total - self.GIB - self.others - self.reserved, total

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return self.reserved

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")

    def empty_cache(self) -> None:
        self.calls.append("empty")

    def synchronize(self) -> None:
        self.calls.append("sync")

    def step(self) -> None:
        self.calls.append("step")
        self.peak, self.reserved = 20 * self.GIB, 22 * self.GIB


def test_the_kv_cache_gets_what_a_maximal_step_leaves_of_the_card() -> None:
    memory = FakeCudaMemory()
    profile = profile_gpu_memory(memory, memory.step)
    assert memory.calls[:3] == ["empty", "reset", "step"]
    gib = FakeCudaMemory.GIB
    assert profile == GpuMemoryProfile(80 * gib, 20 * gib, gib)
    assert gpu_kv_cache_bytes(profile, 0.9) == int(80 * gib * 0.9) - 21 * gib
    assert gpu_kv_cache_bytes(profile, 0.5) == 19 * gib
    with pytest.raises(
        ModelLoadError, match=r"no GPU memory left for the KV cache.*gpu-memory-utilization 0\.25"
    ):
        gpu_kv_cache_bytes(profile, 0.25)


def test_another_engine_on_the_card_does_not_shrink_this_ones_share() -> None:
    """--gpu-memory-utilization is each engine's own share (vLLM's meaning): memory in use when the
    engine starts (another engine's 39 GiB, this one's CUDA context) is not counted as its own, so
    two engines at 0.45 fit on one card; a share larger than what was free is refused with the
    largest that fits."""
    memory = FakeCudaMemory(others_gib=39)
    at_start = used_outside_torch(memory)
    gib = FakeCudaMemory.GIB
    assert at_start == 40 * gib
    profile = profile_gpu_memory(memory, memory.step, at_start)
    assert profile == GpuMemoryProfile(80 * gib, 20 * gib, 0, 40 * gib)
    assert gpu_kv_cache_bytes(profile, 0.45) == int(80 * gib * 0.45) - 20 * gib
    with pytest.raises(ModelLoadError, match=r"utilization 0\.6 asks for 48\.00 GiB.*at most 0\.50 fits"):
        gpu_kv_cache_bytes(profile, 0.6)
    # Without the reading at start, the other engine's memory would have been this one's.
    unread = FakeCudaMemory(others_gib=39)
    assert profile_gpu_memory(unread, unread.step).non_torch_bytes == 40 * gib


def test_the_maximal_step_that_sizes_the_gpu_kv_cache_runs(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the KV cache is sized by running one step as large as the scheduler allows
    (runner._run_maximal_step, under profile_gpu_memory); the step itself is device-free, so it
    runs here: every sequence it makes up goes through batch building and sampling as a real one
    (a made-up sequence without a request once broke every GPU engine start), its logits through
    the batched sampler with top_p on (whose temporaries the KV cache must leave room for)."""
    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=70)
    runner = engine.runner
    kv_caches = runner.kv_caches
    calls: list[int] = []
    sampled: list[tuple[int, float]] = []
    execute = runner.execute

    def counting_execute(scheduled):  # type: ignore[no-untyped-def]
        calls.append(sum(s.num_new_tokens for s in scheduled))
        return execute(scheduled)

    def counting_sample_rows(logits, params, shared, seeded):  # type: ignore[no-untyped-def]
        sampled.append((len(logits), min(p.top_p for p in params)))
        return sample_rows(logits, params, shared, seeded)

    runner.execute = counting_execute  # type: ignore[method-assign]
    monkeypatch.setattr(runner_module, "sample_rows", counting_sample_rows)
    runner._run_maximal_step()
    assert calls == [70]
    assert sampled == [(4, 0.9)]
    assert not hasattr(runner, "kv_caches")  # the step's own small cache is dropped
    runner.kv_caches = kv_caches
    runner.execute = execute  # type: ignore[method-assign]
    engine.add_request("after", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(run_checked(engine)["after"]) == 3
