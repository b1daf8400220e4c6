"""The fp8 KV cache (--kv-cache-dtype): saturating casts, every PyTorch attention path against a dense
float64 reference over the fp8-rounded keys and values, and the engine with it (block count, greedy
tokens through preemption and prefix-cache hits, what it reports). The Triton kernels' fp8 reads
and writes are in test_triton_attention.py."""

from __future__ import annotations

import logging
import math
import pathlib
import shutil

import pytest
import torch
from corral_engine.args import ArgumentError, EngineArgs
from corral_engine.model.attention import AttentionContext, DecodeBatch, SeqAttention, paged_attention
from corral_engine.model.config import load_model_config
from corral_engine.model.kv_dtype import kv_cache_dtype, to_cache
from corral_engine.outputs import EngineStats
from corral_engine.sampling_params import SamplingParams
from corral_engine.server.metrics import _SnapshotCollector
from corral_engine.settings import EngineSettings
from safetensors.torch import load_file, save_file

from tests.engine.helpers import make_engine, random_prompts, run_checked

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_casts_saturate_at_the_formats_largest_value() -> None:
    x = torch.tensor([0.3, -1.0, 447.0, 449.0, 1000.0, -1e6, 6e4, -7e4, float("inf")])
    e4m3 = to_cache(x, E4M3).float()
    assert e4m3.tolist()[2:] == [448.0, 448.0, 448.0, -448.0, 448.0, -448.0, 448.0]
    e5m2 = to_cache(x.bfloat16(), E5M2).float()
    assert e5m2.tolist()[4:] == [1024.0, -57344.0, 57344.0, -57344.0, 57344.0]
    assert to_cache(x, torch.float32) is x  # a cache in the model's dtype: no cast
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.float32) == E4M3
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == E5M2
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 dense attention of one sequence ([nq, H, D] queries over [L, KVH, D] keys), GQA,
    bottom-right causal."""
    nq, num_heads, head_dim = q.shape
    num_keys, group = k.shape[0], num_heads // k.shape[1]
    kd, vd = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) / math.sqrt(head_dim)
    allowed = torch.arange(num_keys)[None, :] <= (num_keys - nq + torch.arange(nq))[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vd)


def _kv(num: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[num, 2, 8] rows of ~N(0, 4) with some entries past e4m3's 448 (they must saturate there)."""
    x = 2 * torch.randn((num, 2, 8), generator=gen)
    x[torch.rand(x.shape, generator=gen) < 0.05] = 1000.0
    x[torch.rand(x.shape, generator=gen) < 0.05] = -600.0
    return x.to(dtype)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [0, 4], ids=["sdpa", "matmul"])
def test_every_pytorch_path_attends_the_rounded_cache(
    cache_dtype: torch.dtype, dtype: torch.dtype, block_rows: int
) -> None:
    """One step: a fresh prompt (its own new rows), a chunk after a cached prefix (gathered from
    the cache) and two decodes (the batched decode's gather), over a cache with stale junk."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim = 4, 2, 8
    # (cached tokens, new tokens, block table): fresh prompt, chunk after a prefix, two decodes.
    seqs = [(0, 9, [6, 1, 8]), (7, 5, [3, 9, 0]), (10, 1, [2, 5, 11]), (4, 1, [7, 4])]
    k_cache = to_cache(_kv(12 * BLOCK, gen, dtype), cache_dtype).view(12, BLOCK, kv_heads, dim)
    v_cache = to_cache(_kv(12 * BLOCK, gen, dtype), cache_dtype).view(12, BLOCK, kv_heads, dim)
    num_new = sum(n for _, n, _ in seqs)
    k_new, v_new = _kv(num_new, gen, dtype), _kv(num_new, gen, dtype)
    q = (0.05 * torch.randn((num_new, heads, dim), generator=gen)).to(dtype)
    slots, attention, decodes, start = [], [], [], 0
    for cached, n, table in seqs:
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + n)]
        if n == 1:
            decodes.append((start, cached + 1, table + [0] * (3 - len(table))))
        else:
            attention.append(SeqAttention(start, start + n, cached + n, torch.tensor(table)))
        start += n
    flat_k = k_cache.view(-1, kv_heads, dim).clone()  # what the cache holds before the step
    flat_v = v_cache.view(-1, kv_heads, dim).clone()
    batch = DecodeBatch(
        torch.tensor([r for r, _, _ in decodes]),
        torch.tensor([t for _, _, t in decodes]),
        torch.tensor([n for _, n, _ in decodes]),
    )
    ctx = AttentionContext(torch.tensor(slots), attention, BLOCK, [batch], prompt_block_rows=block_rows)
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, ctx, dim**-0.5, None)

    flat_k[slots], flat_v[slots] = to_cache(k_new, cache_dtype), to_cache(v_new, cache_dtype)
    assert torch.equal(k_cache.view(-1, kv_heads, dim).float(), flat_k.float())  # the writes
    assert torch.equal(v_cache.view(-1, kv_heads, dim).float(), flat_v.float())
    start = 0
    for cached, n, table in seqs:
        ctx_slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached + n)]
        want = _reference(q[start : start + n], flat_k[ctx_slots], flat_v[ctx_slots])
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (0.02 * want.abs().max().item(), 0.02)
        torch.testing.assert_close(out[start : start + n].double(), want, atol=atol, rtol=rtol)
        start += n


def test_the_same_bytes_hold_twice_the_blocks_of_a_bf16_model(tiny_model_dir: pathlib.Path) -> None:
    values_per_block = load_model_config(tiny_model_dir).kv_bytes_per_token * 16  # K and V, 16 tokens
    budget = 300 * values_per_block + 5  # not a whole number of blocks of either size
    blocks = {}
    for name in ("auto", "fp8"):
        engine = make_engine(
            tiny_model_dir,
            dtype="bfloat16",
            num_kv_blocks=None,
            kv_cache_memory_bytes=budget,
            kv_cache_dtype=name,
        )
        blocks[name] = engine.runner.num_kv_blocks
        assert engine.runner.kv_caches[0][0].dtype == (E4M3 if name == "fp8" else torch.bfloat16)
    assert blocks == {"auto": budget // (2 * values_per_block), "fp8": budget // values_per_block}
    assert blocks["fp8"] == 2 * blocks["auto"]


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    final = run_checked(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_preemption_and_prefix_hits_leave_fp8_greedy_tokens_unchanged(
    tiny_model_dir: pathlib.Path, dtype: str
) -> None:
    """A roomy cache without prefix caching, against a cache so small that sequences are
    preempted and recomputed, and against prefix-cache hits on a shared 12-token head: an fp8
    cache read back gives the same rows whichever path wrote or reads them."""
    shared = random_prompts(1, 500, seed=3, min_len=12, max_len=12)[0]
    prompts = [shared + tail for tail in random_prompts(4, 500, seed=4, min_len=1, max_len=9)]
    prompts += random_prompts(3, 500, seed=5, min_len=5, max_len=20)
    common = {"dtype": dtype, "kv_cache_dtype": "fp8", "block_size": 4}
    roomy = make_engine(tiny_model_dir, enable_prefix_caching=False, **common)
    expected = _greedy(roomy, prompts)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in expected)
    small = make_engine(tiny_model_dir, num_kv_blocks=24, enable_prefix_caching=False, **common)
    assert _greedy(small, prompts) == expected
    assert small.stats().num_preemptions_total > 0
    cached = make_engine(tiny_model_dir, max_num_seqs=1, **common)  # one at a time: later ones hit
    assert _greedy(cached, prompts) == expected
    assert cached.stats().num_prefix_cache_hits_total >= 3 * 12


def test_triton_and_its_decode_graphs_read_the_fp8_cache_as_pytorch_does(
    tiny_model_dir: pathlib.Path,
) -> None:
    """The Triton backend (interpreted, with decode graphs replayed eagerly over their buffers) and
    PyTorch's SDPA path give the same greedy tokens from an fp8 cache, preempting on a small one."""
    pytest.importorskip("triton")
    from corral_engine.model.cuda_graphs import EagerCapture

    prompts = random_prompts(5, 500, seed=8, min_len=2, max_len=30)
    common = {"kv_cache_dtype": "fp8", "block_size": 8, "max_num_seqs": 4}
    expected = _greedy(make_engine(tiny_model_dir, attention_backend="sdpa", **common), prompts)
    capture = EagerCapture()
    engine = make_engine(
        tiny_model_dir,
        EngineSettings(triton_interpret=True),
        graph_capture=capture,
        attention_backend="triton",
        num_kv_blocks=8,
        **common,
    )
    assert _greedy(engine, prompts) == expected
    assert capture.replayed and engine.stats().num_preemptions_total > 0


def test_the_start_up_log_and_the_metrics_say_fp8(
    tiny_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="corral_engine.model.runner")
    engine = make_engine(tiny_model_dir, dtype="bfloat16", kv_cache_dtype="fp8_e5m2", block_size=8)
    assert "KV blocks of 8 tokens (float8_e5m2)" in caplog.text
    stats = engine.stats()
    assert stats.cache_dtype == "fp8_e5m2"
    (info,) = [
        m for m in _SnapshotCollector(lambda: stats, "m").collect() if m.name == "vllm:cache_config_info"
    ]
    assert info.samples[0].labels["cache_dtype"] == "fp8_e5m2"
    assert EngineStats().cache_dtype == "auto"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_checkpoint_kv_scales_are_skipped_with_a_warning(
    tiny_model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
    kv_cache_dtype: str,
) -> None:
    """vLLM-format fp8 checkpoints carry self_attn.k_scale / v_scale: loaded either way, not applied."""
    model_dir = tmp_path / "with-kv-scales"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    for name in ("k_scale", "v_scale"):
        weights[f"model.layers.0.self_attn.{name}"] = torch.tensor(2.0)
    save_file(weights, model_dir / "model.safetensors")
    caplog.set_level(logging.WARNING, logger="corral_engine.model.loader")
    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    assert len(_greedy(engine, [[5, 6, 7]])[0]) == GREEDY.max_tokens
    assert "the checkpoint's 2 KV-cache scales (k_scale, v_scale) are not applied" in caplog.text


def test_an_unknown_kv_cache_dtype_is_refused(tiny_model_dir: pathlib.Path) -> None:
    with pytest.raises(ArgumentError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="int8")  # type: ignore[arg-type]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernels")
def test_native_decode_reads_fp8_and_the_decode_stack_steps_aside(
    tiny_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The native paged decode kernel reads the fp8 cache; the native decode stack (bf16 caches
    only) is off, and the start-up log says why. Greedy tokens as PyTorch's SDPA path gives them
    (float32: in bf16 the two paths' roundings already part greedy tokens of the random tiny model)."""
    caplog.set_level(logging.INFO, logger="corral_engine.model.runner")
    settings = EngineSettings(native_kernels=True)
    engine = make_engine(tiny_model_dir, settings, dtype="bfloat16", kv_cache_dtype="fp8")
    assert engine.runner.attention_backend == "native" and engine.runner.batches.decode_kernel is not None
    assert engine.runner.model.decode_stack is None
    assert "native decode stack does not take a KV cache that is not contiguous bf16" in caplog.text
    prompts = random_prompts(4, 500, seed=9, min_len=3, max_len=20)
    native = make_engine(tiny_model_dir, settings, kv_cache_dtype="fp8")
    assert native.runner.attention_backend == "native"
    sdpa = make_engine(tiny_model_dir, settings, attention_backend="sdpa", kv_cache_dtype="fp8")
    assert _greedy(native, prompts) == _greedy(sdpa, prompts)
