"""The native paged decode kernel against the PyTorch decode path, on hand-made paged caches."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from corral_engine.model import native
from corral_engine.model.attention import DecodeBatch, _decode_attention
from corral_engine.model.kv_dtype import to_cache
from corral_engine.settings import EngineSettings

from tests.engine.helpers import cpu_has

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernel")


def paged_case(
    lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, padded block tables and lengths; each sequence's blocks scattered."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables = []
    num_blocks = 1 + sum(-(-n // block_size) for n in lens)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    for n in lens:
        tables.append([free.pop() for _ in range(-(-n // block_size))])
    width = max(len(t) for t in tables)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((len(lens), num_kv_heads * group, head_dim), generator=gen).to(dtype)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.long)


def reference(q, k_cache, v_cache, block_tables, ctx_lens, scale, window):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(q)
    batch = DecodeBatch(torch.arange(q.shape[0]), block_tables, ctx_lens)
    _decode_attention(q, k_cache, v_cache, batch, k_cache.shape[1], scale, window, out)
    return out


@needs_compiler
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    # GQA, MHA with the 128 specialisation, generic; then shapes the AMX tiles take where the CPU
    # has them (two 16-key slices a block, 16 query heads a KV head: a full tile)
    [(4, 3, 64, 16), (2, 1, 128, 8), (1, 4, 32, 5), (2, 8, 128, 32), (1, 16, 64, 16)],
)
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("num_seqs", [3, 40], ids=["one-head-per-item", "all-heads-per-item"])
def test_kernel_matches_the_pytorch_path(
    dtype: torch.dtype,
    atol: float,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    num_seqs: int,
) -> None:
    kernel = native.load_paged_decode(EngineSettings(native_kernels=True))
    assert kernel is not None and kernel.supports(dtype, torch.device("cpu"))
    # Few sequences: one KV head per work item; many (>= 4 per thread): whole sequences per item.
    lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 57, 130] * 6
    lens = lens[:num_seqs]
    case = paged_case(lens, num_kv_heads, group, head_dim, block_size, dtype, seed=head_dim + group)
    scale = head_dim**-0.5
    got = kernel(*case, scale, window)
    want = reference(*case, scale, window)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@needs_compiler
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"]
)
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_reads_an_fp8_cache_as_the_pytorch_path(
    cache_dtype: torch.dtype, dtype: torch.dtype, atol: float, window: int | None
) -> None:
    kernel = native.load_paged_decode(EngineSettings(native_kernels=True))
    assert kernel is not None and kernel.supports(dtype, torch.device("cpu"), cache_dtype)
    lens = [1, 2, 16, 17, 47, 57, 130] * 6
    q, k_cache, v_cache, tables, ctx_lens = paged_case(lens, 4, 3, 64, 16, dtype, seed=5)
    # Keys of e4m3's whole range (some saturated at 448 by the cast) would swamp the tolerance in
    # the scores; values take it whole.
    k_cache = to_cache(k_cache * 4, cache_dtype)
    v_cache = to_cache(v_cache * 300, cache_dtype)
    got = kernel(q, k_cache, v_cache, tables, ctx_lens, 0.125, window)
    want = reference(q, k_cache, v_cache, tables, ctx_lens, 0.125, window)  # converts after its gathers
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), want.float(), atol=atol * 300, rtol=1e-5 if dtype == torch.float32 else 2e-2
    )


@needs_compiler
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_kernel_decodes_every_finite_fp8_code_exactly(cache_dtype: torch.dtype) -> None:
    # Four one-token contexts: each output row is its one value row (softmax weight 1), which
    # holds 64 of the 256 codes; the inf and NaN codes (never written) are zeroed.
    kernel = native.load_paged_decode(EngineSettings(native_kernels=True))
    assert kernel is not None
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    raw[~raw.view(cache_dtype).float().isfinite()] = 0
    codes = raw.view(cache_dtype)
    v_cache = codes.view(4, 1, 1, 64)  # [blocks, block_size 1, one KV head, D]
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(4, 1, 64)
    tables = torch.arange(4).view(4, 1)
    got = kernel(q, k_cache, v_cache, tables, torch.ones(4, dtype=torch.long), 0.125, None)
    assert torch.equal(got.view(-1), codes.float())


@needs_compiler
@pytest.mark.skipif(not cpu_has("amx_bf16"), reason="this CPU has no AMX tiles")
def test_on_a_cpu_with_amx_the_bf16_kernel_uses_the_tiles() -> None:
    kernel = native.load_paged_decode(EngineSettings(native_kernels=True))
    assert kernel is not None
    bf16 = torch.bfloat16
    assert kernel.uses_amx(bf16, bf16, block_size=16, group=3, head_dim=64)
    assert kernel.uses_amx(bf16, bf16, block_size=32, group=16, head_dim=128)
    # shapes and dtypes the tiles do not take go through the float32 loops
    assert not kernel.uses_amx(bf16, bf16, block_size=8, group=3, head_dim=64)
    assert not kernel.uses_amx(bf16, bf16, block_size=16, group=17, head_dim=64)
    assert not kernel.uses_amx(bf16, bf16, block_size=16, group=3, head_dim=96)
    assert not kernel.uses_amx(torch.float32, torch.float32, block_size=16, group=3, head_dim=64)
    assert not kernel.uses_amx(bf16, torch.float8_e4m3fn, block_size=16, group=3, head_dim=64)


@needs_compiler
@pytest.mark.parametrize("window", [None, 21])
def test_bf16_kernel_is_float32_attention_rounded_once(window: int | None) -> None:
    """Whichever arithmetic runs (AMX tiles or float32 loops), the bf16 kernel's output is the
    float32 attention of its bf16 inputs, rounded to bf16 once: the AMX path's bf16 products and
    split probabilities lose nothing a bf16 output can show."""
    kernel = native.load_paged_decode(EngineSettings(native_kernels=True))
    assert kernel is not None
    lens = [1, 15, 16, 17, 63, 200, 333] * 6
    case = paged_case(lens, 4, 3, 64, 16, torch.bfloat16, seed=11)
    got = kernel(*case, 0.125, window)
    want = reference(*(t.float() if t.is_floating_point() else t for t in case), 0.125, window)
    # one bf16 rounding is 2^-9 relative; allow two, plus an absolute floor for outputs near zero
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3)


@needs_compiler
def test_kernel_rejects_non_contiguous_inputs() -> None:
    kernel = native.load_paged_decode(EngineSettings(native_kernels=True))
    assert kernel is not None
    q, k_cache, v_cache, tables, lens = paged_case([5, 9], 2, 2, 64, 4, torch.float32, seed=0)
    with pytest.raises(native.NativeKernelError):
        kernel(q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, tables, lens, 0.1, None)
    with pytest.raises(native.NativeKernelError):
        kernel(q, k_cache, v_cache, tables.to(torch.int32), lens, 0.1, None)


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_NATIVE_ATTENTION", "0")
    settings = EngineSettings()
    assert not settings.native_kernels
    assert native.load_paged_decode(settings) is None


@needs_compiler
def test_a_failed_build_says_why(tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return missing_symbol; }\n")
    with pytest.raises(native.NativeKernelError, match="missing_symbol"):
        native.build(broken, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so"))


@needs_compiler
def test_builds_once_then_reuses_the_cached_library(tmp_path: Path) -> None:
    first = native.build(native.SOURCE, cache_dir=tmp_path)
    assert first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert native.build(native.SOURCE, cache_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp


@needs_compiler
def test_a_changed_header_builds_a_new_library(tmp_path: Path) -> None:
    source, header = tmp_path / "k.c", tmp_path / "k.h"
    source.write_text('#include "k.h"\nint f(void) { return VALUE; }\n')
    header.write_text("#define VALUE 1\n")
    first = native.build(source, cache_dir=tmp_path / "cache")
    header.write_text("#define VALUE 2\n")
    assert native.build(source, cache_dir=tmp_path / "cache") != first


def test_without_a_compiler_the_engine_takes_the_pytorch_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A machine with no C compiler (faked by pointing CC at nothing, with an empty kernel cache):
    the loaders say so and the runner runs without native kernels."""
    from corral_engine.args import EngineArgs
    from corral_engine.model.config import load_model_config
    from corral_engine.model.llama import MLP, RMSNorm
    from corral_engine.model.runner import ModelRunner

    settings = EngineSettings(compiler=str(tmp_path / "no-cc"), kernel_cache_dir=tmp_path / "cache")
    assert native.load_paged_decode(settings) is None and native.load_fused_ops(settings) is None
    args = EngineArgs(model=str(tiny_model_dir), dtype="bfloat16")
    runner = ModelRunner(load_model_config(tiny_model_dir), args, 64, settings)
    assert runner.batches.decode_kernel is None
    assert all(m.fused_ops is None for m in runner.model.modules() if isinstance(m, RMSNorm | MLP))


@needs_compiler
def test_with_a_compiler_the_runner_hands_the_fused_ops_to_the_model(tiny_model_dir: Path) -> None:
    from corral_engine.args import EngineArgs
    from corral_engine.model.config import load_model_config
    from corral_engine.model.llama import MLP, RMSNorm
    from corral_engine.model.runner import ModelRunner

    args = EngineArgs(model=str(tiny_model_dir), dtype="bfloat16")
    runner = ModelRunner(load_model_config(tiny_model_dir), args, 64, EngineSettings(native_kernels=True))
    assert runner.batches.decode_kernel is not None
    modules = [m for m in runner.model.modules() if isinstance(m, RMSNorm | MLP)]
    assert modules and all(m.fused_ops is not None for m in modules)
