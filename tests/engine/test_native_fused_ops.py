"""bf16 on the CPU: the native fused ops (SiLU-and-multiply, RMSNorm, the residual add before it,
rotary embedding) against references that do not depend on the CPU, or against PyTorch's own bf16
expressions where those round the same on every CPU, and the Linear layer's upcast and prepacked
paths. Which path the runner picks on which CPU is tested in test_matmul_plan.py."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from corral_engine.model import native
from corral_engine.model.llama import MLP, Linear, RMSNorm
from corral_engine.model.rotary import rotate_half
from corral_engine.settings import EngineSettings

from tests.engine.helpers import UNIT_ROUNDOFF, check_linear_contract, cpu_has

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernels")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values; both are bf16)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 -> float64: one rounding to nearest (through float32, which holds every bf16
    rounding boundary exactly, so only a float64 value within 2^-29 of a tie can round twice)."""
    return x.float().bfloat16().double()


def _assert_meets_contract(
    got: torch.Tensor, stepwise: torch.Tensor, exact: torch.Tensor, slack: float
) -> None:
    """The kernels' numerical contract, the same on every CPU.

    `stepwise` is the kernel's formula evaluated in float64 with each documented bf16 rounding
    applied once; it depends on no ISA. The kernel computes in float32 (-march=native -ffast-math:
    its exp, division and sum order differ per ISA), so an intermediate that lies within float32
    error of a bf16 tie may round the other way: 1 ulp of the intermediate, which moves the output
    by at most 2 ulps. That happens rarely (< 1% of elements). Against the exact (unrounded) value
    the two roundings bound the relative error by 2u + u^2, plus the float32 arithmetic's `slack`.
    """
    assert got.dtype == torch.bfloat16 and got.shape == stepwise.shape
    ulps = _ulps_apart(got, stepwise.float().bfloat16())
    assert int(ulps.max()) <= 2
    assert float((ulps == 0).float().mean()) > 0.99
    rel = (got.double() - exact).abs() / exact.abs()
    assert float(rel[exact != 0].max()) <= 2 * UNIT_ROUNDOFF + UNIT_ROUNDOFF**2 + slack
    assert bool((got[exact == 0] == 0).all())


@pytest.fixture(scope="module")
def ops() -> native.FusedOps:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the kernels")
    loaded = native.load_fused_ops(EngineSettings(native_kernels=True))
    assert loaded is not None, "a C compiler is present, so the fused ops must build"
    return loaded


@pytest.mark.parametrize(("rows", "size"), [(1, 2048), (7, 96), (64, 2048), (300, 5), (128, 4096)])
def test_silu_and_mul_meets_its_contract(ops: native.FusedOps, rows: int, size: int) -> None:
    """bf16(bf16(silu(gate)) * up), as `F.silu(x[:, :I]) * x[:, I:]` rounds it."""
    gate_up = (torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gate, up = gate_up[:, :size].double(), gate_up[:, size:].double()
    silu = gate / (1 + torch.exp(-gate))
    # float32 exp and division: a few float32 ulps (2^-24 each) before the first rounding.
    _assert_meets_contract(ops.silu_and_mul(gate_up), _bf16(silu) * up, silu * up, slack=2.0**-18)


@pytest.mark.parametrize(
    ("shape", "eps"), [((1, 768), 1e-6), ((33, 768), 1e-5), ((5, 4, 64), 1e-6), ((64, 4096), 1e-6)]
)
def test_rms_norm_meets_its_contract(ops: native.FusedOps, shape: tuple[int, ...], eps: float) -> None:
    """w * bf16(x / sqrt(mean(x^2) + eps)), as `w * F.rms_norm(x.float()).bfloat16()` rounds it."""
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * 3).bfloat16()
    weight = (1 + torch.randn(shape[-1], generator=gen) / 4).bfloat16()
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    # A float32 sum of H squares in any order is within H * 2^-24 of the exact one (2^-12 at 4096).
    slack = shape[-1] * 2.0**-24
    _assert_meets_contract(
        ops.rms_norm(x, weight, eps), weight.double() * _bf16(normed), weight.double() * normed, slack
    )


@pytest.mark.parametrize(("rows", "size"), [(1, 768), (16, 768), (40, 96)])
def test_add_rms_norm_is_the_add_then_the_norm(ops: native.FusedOps, rows: int, size: int) -> None:
    """The sum is PyTorch's bf16 add to the bit (one rounding of an exact float32 sum), and the
    norm is the kernel's own norm of that sum: identical bits, on any CPU."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, size, generator=gen) * 3).bfloat16()
    residual = (torch.randn(rows, size, generator=gen) * 30).bfloat16()
    weight = (1 + torch.randn(size, generator=gen) / 4).bfloat16()
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, ops.rms_norm(x + residual, weight, 1e-6))


def _rotary_case(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused QKV output [T, (12 + 2 * 4) * 64] and cos/sin [T, 1, 64] as Rotary.cos_sin makes them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, 20 * 64, generator=gen) * 8).bfloat16()
    angles = torch.rand(tokens, 32, generator=gen) * 1000
    emb = torch.cat((angles, angles), dim=-1)
    return qkv, emb.cos().bfloat16().unsqueeze(1), emb.sin().bfloat16().unsqueeze(1)


@pytest.mark.parametrize("tokens", [1, 3, 16, 200])
def test_rotary_is_torchs_expression_to_the_bit(ops: native.FusedOps, tokens: int) -> None:
    """In place on the q and k heads of the fused QKV rows (v untouched), with exactly the bits of
    `x * cos + rotate_half(x) * sin` in bf16: a product of two bf16 values is exact in float32, so
    every rounding is the same on every CPU."""
    qkv, cos, sin = _rotary_case(tokens, tokens)
    q = qkv[:, :768].view(tokens, 12, 64)
    k = qkv[:, 768:1024].view(tokens, 4, 64)
    want_q, want_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    v_before = qkv[:, 1024:].clone()
    assert ops.supports_rotary(q, k, cos, sin)
    ops.rotary(q, k, cos, sin)
    assert torch.equal(q, want_q)
    assert torch.equal(k, want_k)
    assert torch.equal(qkv[:, 1024:], v_before)


def test_rotary_refuses_layouts_it_cannot_read(ops: native.FusedOps) -> None:
    qkv, cos, sin = _rotary_case(4, 0)
    q = qkv[:, :768].view(4, 12, 64)
    k = qkv[:, 768:1024].view(4, 4, 64)
    assert not ops.supports_rotary(q.float(), k, cos, sin)  # float32: PyTorch's path
    assert not ops.supports_rotary(q.transpose(0, 1), k, cos, sin)  # heads not contiguous
    assert not ops.supports_rotary(q, k, cos.float(), sin)
    assert not ops.supports_rotary(q, k, cos, sin[..., :32])  # another head size


@needs_cc
def test_attention_rotates_through_the_kernel_with_the_same_bits(
    ops: native.FusedOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's rotary step through the native kernel gives PyTorch's bits: its output, and the
    K/V it writes to the cache, are the same through both paths."""
    from corral_engine.model.attention import AttentionContext, SeqAttention
    from corral_engine.model.llama import Attention

    config = SimpleNamespace(
        num_heads=12, num_kv_heads=4, head_dim=64, sliding_windows=[None], hidden_size=256,
        qkv_bias=False, o_bias=False, qk_norm=False, rms_norm_eps=1e-6, gemma=None, attention_scale=None,
        family=None,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = Attention(config, 0, None).bfloat16()  # type: ignore[arg-type]
    tokens = 5
    _, cos, sin = _rotary_case(tokens, 1)
    x = torch.randn(tokens, 256).bfloat16()
    calls: list[int] = []
    kernel = ops.rotary

    def counted(*args: torch.Tensor) -> None:
        calls.append(1)
        kernel(*args)

    monkeypatch.setattr(ops, "rotary", counted)
    results = []
    for fused in (None, ops):
        layer.fused_ops = fused
        cache = (torch.zeros(4, 16, 4, 64).bfloat16(), torch.zeros(4, 16, 4, 64).bfloat16())
        prompt = SeqAttention(q_start=0, q_end=tokens, ctx_len=tokens, block_ids=torch.tensor([0]))
        ctx = AttentionContext(slot_mapping=torch.arange(tokens), seqs=[prompt], block_size=16)
        with torch.inference_mode():
            out = layer(x, cos, sin, cache, ctx)
        results.append((out, cache[0].clone()))
    assert calls == [1]  # the second pass went through the kernel
    assert torch.equal(results[0][1], results[1][1])  # rotated K written to the cache
    assert torch.equal(results[0][0], results[1][0])


def test_torchs_own_expressions_meet_the_same_contract() -> None:
    """The contract is what a float32 computation of these formulas gives on any CPU: PyTorch's
    bf16 expressions, which the kernels replace, meet it too (they round per ISA as well)."""
    gate_up = (torch.randn(64, 4096, generator=torch.Generator().manual_seed(64)) * 4).bfloat16()
    gate, up = gate_up[:, :2048].double(), gate_up[:, 2048:].double()
    silu = gate / (1 + torch.exp(-gate))
    got = F.silu(gate_up[:, :2048]) * gate_up[:, 2048:]
    _assert_meets_contract(got, _bf16(silu) * up, silu * up, slack=2.0**-18)


class _RecordingOps:
    """Stands in for the native FusedOps and records which path a module took."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    supports = staticmethod(native.FusedOps.supports)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls.append("rms")
        return torch.zeros_like(x)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.calls.append("silu")
        return gate_up[:, : gate_up.shape[1] // 2]


def test_modules_take_the_fused_path_only_where_it_applies() -> None:
    fake = _RecordingOps()
    norm = RMSNorm(16, 1e-6)
    norm.fused_ops = fake  # type: ignore[assignment]
    norm(torch.randn(3, 16))  # float32: PyTorch path
    norm.bfloat16()(torch.randn(3, 16).bfloat16())
    norm(torch.randn(3, 32).bfloat16()[:, ::2])  # not contiguous: PyTorch path
    assert fake.calls == ["rms"]
    bare = RMSNorm(16, 1e-6).bfloat16()  # no fused ops given (not CPU, or they did not build)
    torch.testing.assert_close(bare(torch.ones(2, 16).bfloat16()), torch.ones(2, 16).bfloat16())


@needs_cc
def test_switch_turns_the_fused_ops_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_NATIVE_ATTENTION", "0")
    assert native.load_fused_ops(EngineSettings()) is None
    monkeypatch.delenv("CORRAL_NATIVE_ATTENTION")
    assert native.load_fused_ops(EngineSettings()) is not None


@needs_cc
def test_mlp_output_is_the_same_through_both_paths(ops: native.FusedOps) -> None:
    # What MLP reads.
    config = SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_bias=False, hidden_act="silu")
    torch.manual_seed(0)
    mlp = MLP(config, None).bfloat16()  # type: ignore[arg-type]
    x = torch.randn(9, 64).bfloat16()
    with torch.inference_mode():
        plain = mlp(x)
        mlp.fused_ops = ops
        fused = mlp(x)
    torch.testing.assert_close(fused, plain, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "size", "out"), [(1, 768, 1280), (3, 100, 40), (7, 2304, 768), (8, 64, 1000)]
)
def test_linear_rows_meets_its_contract(
    ops: native.FusedOps, rows: int, size: int, out: int, bias: bool
) -> None:
    check_linear_contract(ops.linear_rows, rows, size, out, bias)


@needs_cc
@pytest.mark.parametrize(("march", "needs"), [("x86-64-v3", "avx2"), ("x86-64", "sse2")])
def test_every_build_of_linear_rows_meets_its_contract(tmp_path: Path, march: str, needs: str) -> None:
    """The engine builds for this CPU only (-march=native); the AVX2 loop and the plain one are
    built here explicitly so each is checked on any x86 machine that runs them."""
    if not cpu_has(needs):
        pytest.skip(f"this CPU cannot run -march={march} code")
    flags = [f if f != "-march=native" else f"-march={march}" for f in native.FLAGS]
    target = tmp_path / f"fused_ops-{march}.so"
    subprocess.run(["cc", *flags, "-o", str(target), str(native.FUSED_SOURCE), "-lm"], check=True)
    ops = native.FusedOps(ctypes.CDLL(str(target)))
    for rows, size, out in [
        (1, 768, 1280),
        (2, 13, 9),
        (3, 100, 40),
        (5, 771, 33),
        (7, 2304, 768),
        (12, 200, 17),
    ]:
        for bias in (False, True):
            check_linear_contract(ops.linear_rows, rows, size, out, bias)


@pytest.mark.parametrize("rows", [1, 7, 8, 64])
def test_linear_takes_the_kernel_below_the_upcast_threshold(
    ops: native.FusedOps, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    calls: list[int] = []
    kernel = ops.linear_rows

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, weight, bias)

    monkeypatch.setattr(ops, "linear_rows", counted)
    torch.manual_seed(rows)
    layer = Linear(48, 40, bias=True).bfloat16()
    layer.upcast_min_rows = layer.kernel_rows = 8  # a CPU without native bf16 (MatmulPlan)
    x = torch.randn(rows, 48).bfloat16()
    without = layer(x)  # no kernel given: F.linear below the threshold, float32 from it on
    layer.fused_ops = ops
    got = layer(x)
    assert calls == ([rows] if rows < 8 else [])
    if rows >= 8:
        assert torch.equal(got, without)  # the upcast path, untouched
    layer.upcast_min_rows = layer.kernel_rows = 0  # native bf16: PyTorch's matmul whatever the rows
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert len(calls) == (1 if rows < 8 else 0)
    layer.kernel_rows = 8  # native bf16 with CORRAL_SMALL_BATCH_KERNEL=1: the kernel below 8 rows
    native = layer(x)
    assert len(calls) == (2 if rows < 8 else 0)
    if rows >= 8:
        assert torch.equal(native, F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [1, 7, 8, 64])
def test_linear_upcasts_bf16_batches_from_the_threshold_on(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(48, 40, bias=True).bfloat16()
    layer.upcast_min_rows = 8
    x = torch.randn(rows, 48).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    bf16 = F.linear(x, layer.weight, layer.bias)
    upcast = F.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16()
    want = upcast if rows >= 8 else bf16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got, bf16, atol=2e-2, rtol=2e-2)  # same product, other rounding
    fp32 = layer.float()  # float32 models are never touched
    torch.testing.assert_close(fp32(x.float()), F.linear(x.float(), fp32.weight, fp32.bias), atol=0, rtol=0)


needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


@needs_mkldnn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_linear_matches_f_linear(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=True)
    x = torch.randn(rows, 96)
    want = F.linear(x, layer.weight, layer.bias)
    layer.prepack(keep_weight=False)
    assert layer.packed is not None and layer.weight.numel() == 0  # the plain copy is released
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@needs_mkldnn
def test_prepacked_engine_generates_what_the_plain_one_does(
    tiny_model_dir: Path,
) -> None:
    from corral_engine.sampling_params import SamplingParams

    from tests.engine.helpers import make_engine

    prompts = [[5 + i, 9, 33 + 2 * i, 7] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for switch in ("0", "auto"):
        engine = make_engine(tiny_model_dir, EngineSettings(prepack=switch))  # float32
        is_packed = engine.runner.model.lm_head.packed is not None
        assert is_packed == (switch == "auto")
        outputs[switch] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert outputs["auto"] == outputs["0"]


@needs_mkldnn
@pytest.mark.parametrize("rows", [7, 8, 64])
def test_upcast_copy_matches_converting_the_weight_per_call(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=True).bfloat16()
    layer.upcast_min_rows = 8
    x = torch.randn(rows, 96).bfloat16()
    want = layer(x)  # converts the bf16 weight to float32 on this call (or stays bf16 below 8 rows)
    layer.prepack_upcast()
    assert layer.upcast_packed is not None and layer.weight.dtype == torch.bfloat16  # bf16 kept
    if rows >= 8:
        layer.weight.data.zero_()  # large batches must multiply the copy, not the bf16 weight
    got = layer(x)
    assert got.dtype == torch.bfloat16
    if rows < 8:
        torch.testing.assert_close(got, want, atol=0, rtol=0)  # small batches never use the copy
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)  # bf16 rounding


@needs_cc
def test_exponential_race_draws_by_seed_alone(ops: native.FusedOps) -> None:
    """The sampler's native race: a row's token depends on its probabilities and seed only (not on
    the batch), repeats with the seed, never falls on a zero probability, and follows p (not
    normalised) over many seeds."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.15, 0.05]]) * 7.0  # scaled: need not sum to 1
    seeds = torch.arange(40_000, dtype=torch.long) * 7919 + 3
    drawn = ops.exponential_race(probs.expand(len(seeds), -1), seeds)
    assert torch.equal(drawn, ops.exponential_race(probs.expand(len(seeds), -1), seeds))
    for i in (0, 17, 39_999):  # alone, the same draw
        assert ops.exponential_race(probs, seeds[i : i + 1]).item() == drawn[i].item()
    freq = torch.bincount(drawn, minlength=5).double() / len(seeds)
    want = probs[0].double() / probs.sum()
    assert freq[1] == 0.0
    assert torch.all((freq - want).abs() <= 5 * (want * (1 - want) / len(seeds)).sqrt())
    wide = torch.softmax(torch.randn(3, 32_000), dim=-1)  # several chunks of the kernel's loop
    tokens = ops.exponential_race(wide, torch.tensor([1, 2, 3]))
    assert tokens.shape == (3,) and tokens.dtype == torch.long and bool((tokens < 32_000).all())


@pytest.mark.parametrize(
    ("mats", "rows", "group", "cols", "first", "window"),
    [
        (4, 128, 3, 128, 1, None),  # a fresh prompt's first block: the diagonal
        (4, 128, 3, 384, 257, None),  # its third block: two full tiles, then the diagonal
        (2, 5, 2, 29, 25, None),  # a chunk after 24 cached tokens
        (2, 40, 3, 48, 9, 9),  # sliding window: early keys drop out row by row
        (1, 1, 1, 1, 1, None),  # one row, one key
        (3, 7, 4, 50, 44, 16),  # window with a cached prefix, rows ending mid-block
    ],
)
def test_causal_softmax_is_the_masked_softmax(
    ops: native.FusedOps, mats: int, rows: int, group: int, cols: int, first: int, window: int | None
) -> None:
    """Row r of every head sees columns [first + r - window, first + r): the softmax of those
    bf16 scores (float64 here, rounded once), exact zeros everywhere else."""
    torch.manual_seed(rows * 1000 + cols)
    scores = (torch.randn(mats, rows * group, cols) * 4).bfloat16()
    r = torch.arange(rows).repeat_interleave(group)[:, None]
    c = torch.arange(cols)[None, :]
    visible = c < first + r
    if window is not None:
        visible &= c >= first + r - window
    exact = scores.double().masked_fill(~visible, float("-inf")).softmax(-1)
    got = scores.clone()
    ops.causal_softmax(got, rows, first, window)
    assert bool((got[:, ~visible] == 0).all())
    ulps = _ulps_apart(got, exact.float().bfloat16())
    assert int(ulps.max()) <= 1
    assert float((ulps == 0).float().mean()) > 0.99
    # What the PyTorch path computes (masked_fill_ then a bf16 softmax) is within the same bound.
    torch_path = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    assert int(_ulps_apart(got, torch_path).max()) <= 1


@pytest.mark.parametrize("scale", [0.125, 128**-0.5, 1.0])
def test_causal_softmax_scales_the_scores_as_eager_attention_rounds_them(
    ops: native.FusedOps, scale: float
) -> None:
    """With a scale the kernel takes the unscaled scores: softmax(bf16(scores * scale)), as
    transformers' eager `(q @ k^T) * scaling` in bf16 rounds it, for any scale (a power of two is
    exact; 128 ** -0.5 is not)."""
    torch.manual_seed(5)
    mats, rows, group, cols, first = 4, 16, 3, 40, 25
    scores = (torch.randn(mats, rows * group, cols) * 30).bfloat16()
    r = torch.arange(rows).repeat_interleave(group)[:, None]
    visible = torch.arange(cols)[None, :] < first + r
    scaled = scores * scale  # bf16: one rounding per value
    exact = scaled.double().masked_fill(~visible, float("-inf")).softmax(-1)
    got = scores.clone()
    ops.causal_softmax(got, rows, first, None, scale)
    assert bool((got[:, ~visible] == 0).all())
    assert int(_ulps_apart(got, exact.float().bfloat16()).max()) <= 1
    unscaled = scores.clone()
    ops.causal_softmax(unscaled, rows, first, None)
    assert (scale == 1.0) == torch.equal(got, unscaled)


def _kv_case(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k and v [T, 4, 64] as the model has them: views into one [T, (12 + 8) * 64] QKV output."""
    qkv = torch.randn(tokens, 20 * 64).bfloat16()
    k = qkv[:, 12 * 64 : 16 * 64].view(tokens, 4, 64)
    v = qkv[:, 16 * 64 :].view(tokens, 4, 64)
    return qkv, k, v


@pytest.mark.parametrize("tokens", [3, 300])  # one thread; rows split across threads
def test_write_kv_is_index_copy_into_the_flat_caches(ops: native.FusedOps, tokens: int) -> None:
    torch.manual_seed(tokens)
    _, k, v = _kv_case(tokens)
    assert not k.is_contiguous() and k.stride()[1:] == (64, 1)
    num_blocks, block_size = 40, 16
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[1] = -1  # a padding row: skipped
    want_k, want_v = (torch.randn(num_blocks, block_size, 4, 64).bfloat16() for _ in range(2))
    got_k, got_v = want_k.clone(), want_v.clone()
    real = slots >= 0
    want_k.view(-1, 4, 64).index_copy_(0, slots[real], k[real])
    want_v.view(-1, 4, 64).index_copy_(0, slots[real], v[real])
    ops.write_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_write_kv_refuses_slots_past_the_cache_and_falls_back_for_other_dtypes(ops: native.FusedOps) -> None:
    _, k, v = _kv_case(4)
    k_cache, v_cache = torch.zeros(2, 16, 4, 64).bfloat16(), torch.zeros(2, 16, 4, 64).bfloat16()
    with pytest.raises(native.NativeKernelError, match="past the cache"):
        ops.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 32, 3]))
    k32, v32 = k.float(), v.float()
    caches = torch.zeros(2, 16, 4, 64), torch.zeros(2, 16, 4, 64)
    ops.write_kv(k32, v32, *caches, torch.tensor([5, 0, 31, 7]))  # float32: index_copy_
    assert torch.equal(caches[0].view(-1, 4, 64)[31], k32[2])
    assert torch.equal(caches[1].view(-1, 4, 64)[5], v32[0])


def test_a_prompt_through_the_native_write_and_softmax_is_the_pytorch_path(ops: native.FusedOps) -> None:
    """paged_attention for a fresh 40-token prompt (three blocks of rows), the context's native KV
    write and masked softmax against index_copy_ and PyTorch's softmax: the same cache bits, and
    an output within a bf16 rounding or two."""
    from corral_engine.model.attention import AttentionContext, SeqAttention, paged_attention

    torch.manual_seed(3)
    tokens, block_size = 40, 16
    qkv, k, v = _kv_case(tokens)
    q = qkv[:, : 12 * 64].view(tokens, 12, 64)
    slots = torch.arange(16, 16 + tokens)  # blocks 1, 2, 3
    results = []
    for native_ops in (False, True):
        caches = torch.zeros(6, block_size, 4, 64).bfloat16(), torch.zeros(6, block_size, 4, 64).bfloat16()
        ctx = AttentionContext(
            slot_mapping=slots,
            seqs=[SeqAttention(0, tokens, tokens, torch.tensor([1, 2, 3]))],
            block_size=block_size,
            prompt_block_rows=16,
            prompt_softmax=ops.causal_softmax if native_ops else None,
            kv_write=ops.write_kv if native_ops else None,
        )
        with torch.inference_mode():
            out = paged_attention(q, k, v, *caches, ctx, 64**-0.5, None)
        results.append((out, caches))
    (plain, plain_caches), (fused, fused_caches) = results
    assert all(torch.equal(a, b) for a, b in zip(plain_caches, fused_caches, strict=True))
    assert int(_ulps_apart(fused.abs(), plain.abs()).max()) <= 2
