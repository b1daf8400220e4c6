"""Kernel variants of the triton attention backend. Triton compiles a variant per combination of
constexprs and integer-argument classes (1, a multiple of 16, other) on its first launch: a stall
of a second or more inside whatever step meets it. The per-step integers are unspecialized, and
the runner's warm-up launches every (BLOCK_Q, NUM_SPLITS) a batch can choose before serving.
Checked on CPU through Triton's own specialization rule and the interpreter."""

from __future__ import annotations

import pathlib
import random
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from corral_engine.model import runner as runner_module
from corral_engine.model import triton_attention
from corral_engine.settings import EngineSettings
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from tests.engine.helpers import make_engine, random_prompts
from tests.engine.test_async_scheduling import GREEDY

Launch = tuple[tuple[Any, ...], dict[str, Any]]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Launch]]:
    """Every _attention_kernel launch's arguments (CPU: interpreted, then recorded)."""
    recorded: list[Launch] = []
    real = triton_attention.launcher

    class Recording:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                recorded.append((args, kwargs))
                self.kernel[grid](*args, **kwargs)

            return launch

    def launcher(fn: Any, device: torch.device) -> Any:
        kernel = real(fn, device)
        return Recording(kernel) if fn is triton_attention._attention_kernel else kernel

    monkeypatch.setattr(triton_attention, "launcher", launcher)
    yield recorded


def _variant(launch: Launch) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(constexprs, integer arguments' specialization) as the compiled kernel's binder keys them."""
    jit = triton_attention._compiled(triton_attention._attention_kernel, False)
    args, kwargs = launch
    constexprs, ints = [], []
    for param, value in zip(
        jit.params, [*args, *(kwargs[p.name] for p in jit.params[len(args) :])], strict=True
    ):
        if param.is_constexpr:
            constexprs.append((param.name, value))
        elif isinstance(value, int):
            spec = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize, True)
            ints.append((param.name, spec))
    return tuple(constexprs), tuple(ints)


def test_per_step_integers_compile_no_new_variants(
    tiny_model_dir: pathlib.Path, launches: list[Launch]
) -> None:
    """A serving mix on the engine: one sequence, a few, sixteen; block tables one block wide and
    wider. Each constexpr combination launches with one integer specialization only: the
    sequence count and table width change nothing a compile depends on."""
    engine = make_engine(
        tiny_model_dir, EngineSettings(triton_interpret=True), attention_backend="triton",
        enforce_eager=True, block_size=4, max_num_seqs=16,
    )  # fmt: skip
    rng = random.Random(5)
    for num_seqs in (1, 3, 16):
        prompts = random_prompts(num_seqs, 500, seed=num_seqs, min_len=2, max_len=40)
        engine.generate(prompts, GREEDY.replace(max_tokens=rng.randint(2, 6)))
    values = defaultdict(set)
    for args, _ in launches:
        values["num_seqs"].add(args[11])
    assert {1, 3, 16} <= values["num_seqs"]  # the classes Triton tells apart: 1, other, 16
    keys: dict[tuple[Any, ...], set[tuple[Any, ...]]] = defaultdict(set)
    for launch in launches:
        constexprs, ints = _variant(launch)
        keys[constexprs].add(ints)
    assert all(len(specs) == 1 for specs in keys.values()), keys


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "itemsize"),
    [(32, 8, 128, 2), (8, 8, 64, 2), (28, 4, 128, 2), (4, 2, 16, 4), (16, 1, 256, 4)],
)
def test_the_warm_up_covers_every_batch(heads: int, kv_heads: int, head_dim: int, itemsize: int) -> None:
    """Random batches on a GPU choose only (BLOCK_Q, NUM_SPLITS) pairs the warm-up launches."""
    group, row_bytes = heads // kv_heads, triton_attention._head_dim_pad(head_dim) * itemsize
    warmed = set(triton_attention.warmup_shapes(group, kv_heads, row_bytes))
    rng = random.Random(heads * head_dim)
    chosen = set()
    for _ in range(5000):
        num_seqs = rng.choice([1, 1, 2, 3, 8, 40, 256])
        lengths = [rng.choice([1, 1, 2, 3, 7, 16, 20, 33, 500]) for _ in range(num_seqs)]
        shape = triton_attention.launch_shape(
            group, kv_heads, row_bytes, max(lengths), sum(lengths), num_seqs, compiled=True
        )
        chosen.add(shape)
    assert chosen <= warmed
    assert {b for b, _ in chosen} == {b for b, _ in warmed}  # not a vacuous draw: every tile,
    assert len({s for _, s in chosen}) > 2  # and split counts besides 1


def test_the_warm_up_launches_each_shape(launches: list[Launch]) -> None:
    """warm_up on CPU (interpreted): one launch per warm-up shape, each with its own constexprs,
    for a sliding window too."""
    heads, kv_heads, head_dim, block_size = 2, 1, 16, 4
    k_cache = torch.randn((3, block_size, kv_heads, head_dim))
    v_cache = torch.randn_like(k_cache)
    q_like = torch.empty((1, heads, head_dim))
    shapes = triton_attention.warmup_shapes(heads // kv_heads, kv_heads, 16 * 4)
    assert triton_attention.warm_up(q_like, k_cache, v_cache, 0.25, window=None) == len(shapes)
    launched = {(kw["BLOCK_Q"], kw["NUM_SPLITS"], kw["WINDOW"]) for _, kw in launches}
    assert launched == {(b, s, 0) for b, s in shapes}
    launches.clear()
    triton_attention.warm_up(q_like, k_cache, v_cache, 0.25, window=8)
    assert {kw["WINDOW"] for _, kw in launches} == {8}


def test_the_runner_warms_up_and_reports_a_later_compile(
    tiny_model_dir: pathlib.Path,
    launches: list[Launch],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The runner's warm-up (on CUDA at start; called here on the interpreter) launches the
    warm-up shapes over the model's cache; a step after it that compiles a variant is logged."""
    engine = make_engine(
        tiny_model_dir, EngineSettings(triton_interpret=True), attention_backend="triton", enforce_eager=True
    )
    runner, config = engine.runner, engine.model_config
    count = iter(range(100, 200))
    monkeypatch.setattr(triton_attention, "compiled_variants", lambda: next(count))
    runner._warm_up_attention()
    row_bytes = triton_attention._head_dim_pad(config.head_dim) * 4
    shapes = triton_attention.warmup_shapes(
        config.num_heads // config.num_kv_heads, config.num_kv_heads, row_bytes
    )
    assert len(launches) == len(shapes) * len(set(config.sliding_windows))
    with caplog.at_level("WARNING", logger=runner_module.logger.name):
        engine.generate(random_prompts(2, 500, seed=3, min_len=3, max_len=9), GREEDY.replace(max_tokens=2))
    assert "compiled 1 new Triton kernel variant(s) after the warm-up" in caplog.text


def test_compiled_variants_counts_each_device_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's per-device (kernel cache, ...) tuples, summed; a layout it does not know counts 0."""
    from types import SimpleNamespace

    kernels = [
        SimpleNamespace(device_caches={0: ({"a": 1, "b": 2}, {}, "target"), 1: ({"c": 3}, {})}),
        SimpleNamespace(device_caches={0: "another layout"}),
        SimpleNamespace(),
    ]
    monkeypatch.setattr(triton_attention, "_JIT", kernels)
    assert triton_attention.compiled_variants() == 3
