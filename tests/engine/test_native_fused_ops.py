"""bf16 on the CPU: the native fused ops (SiLU-and-multiply, RMSNorm) against the PyTorch expressions
they replace, and float32 matmuls where the CPU has no native bf16."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from corral_engine.model import native
from corral_engine.model.llama import MLP, Linear, RMSNorm
from corral_engine.model.runner import UPCAST_MIN_ROWS

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernels")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values; both are bf16)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _assert_rounds_like(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical but for a last-place tie now and then (float32 exp and sum order differ)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    ulps = _ulps_apart(got, want)
    assert int(ulps.max()) <= 1
    assert float((ulps == 0).float().mean()) > 0.99


@pytest.fixture(scope="module")
def ops() -> native.FusedOps:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the kernels")
    loaded = native.load_fused_ops()
    assert loaded is not None, "a C compiler is present, so the fused ops must build"
    return loaded


@pytest.mark.parametrize(("rows", "size"), [(1, 2048), (7, 96), (64, 2048), (300, 5)])
def test_silu_and_mul_matches_torch(ops: native.FusedOps, rows: int, size: int) -> None:
    gate_up = (torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    want = F.silu(gate_up[:, :size]) * gate_up[:, size:]
    _assert_rounds_like(ops.silu_and_mul(gate_up), want)


@pytest.mark.parametrize(("shape", "eps"), [((1, 768), 1e-6), ((33, 768), 1e-5), ((5, 4, 64), 1e-6)])
def test_rms_norm_matches_torch(ops: native.FusedOps, shape: tuple[int, ...], eps: float) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * 3).bfloat16()
    weight = (1 + torch.randn(shape[-1], generator=gen) / 4).bfloat16()
    want = weight * F.rms_norm(x.float(), (shape[-1],), eps=eps).bfloat16()
    _assert_rounds_like(ops.rms_norm(x, weight, eps), want)


def test_modules_take_the_fused_path_only_where_it_applies(
    ops: native.FusedOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(type(ops), "rms_norm", lambda self, *a: calls.append("rms") or torch.zeros(1))
    monkeypatch.setattr(type(ops), "silu_and_mul", lambda self, x: calls.append("silu") or x[:, :8])
    norm = RMSNorm(16, 1e-6)
    norm(torch.randn(3, 16))  # float32: PyTorch path
    norm.bfloat16()(torch.randn(3, 16).bfloat16())
    norm(torch.randn(3, 32).bfloat16()[:, ::2])  # not contiguous: PyTorch path
    assert calls == ["rms"]


@needs_cc
def test_switch_turns_the_fused_ops_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.load_fused_ops.cache_clear()
    try:
        assert native.load_fused_ops() is None
    finally:
        monkeypatch.delenv(native.ENV_SWITCH)
        native.load_fused_ops.cache_clear()
    assert native.load_fused_ops() is not None


@needs_cc
def test_mlp_output_is_the_same_through_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_bias=False)  # what MLP reads
    torch.manual_seed(0)
    mlp = MLP(config).bfloat16()  # type: ignore[arg-type]
    x = torch.randn(9, 64).bfloat16()
    with torch.inference_mode():
        fused = mlp(x)
        monkeypatch.setattr("corral_engine.model.llama.load_fused_ops", lambda: None)
        plain = mlp(x)
    torch.testing.assert_close(fused, plain, atol=2e-2, rtol=2e-2)


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


@pytest.mark.parametrize(
    ("env", "native_bf16", "dtype", "rows"),
    [
        ("auto", False, "bfloat16", UPCAST_MIN_ROWS),
        ("auto", True, "bfloat16", 0),
        ("auto", False, "float32", 0),
        ("1", True, "bfloat16", UPCAST_MIN_ROWS),
        ("0", False, "bfloat16", 0),
    ],
)
def test_runner_upcasts_bf16_matmuls_only_without_native_bf16(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    native_bf16: bool,
    dtype: str,
    rows: int,
) -> None:
    from corral_engine.args import EngineArgs
    from corral_engine.model import runner as runner_mod
    from corral_engine.model.config import load_model_config

    monkeypatch.setenv(runner_mod.ENV_UPCAST, env)
    monkeypatch.setattr(runner_mod, "cpu_supports_bf16", lambda: native_bf16)
    config = load_model_config(tiny_model_dir)
    runner = runner_mod.ModelRunner(config, EngineArgs(model=str(tiny_model_dir), dtype=dtype), 64)
    assert runner.upcast_rows == rows
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * config.num_layers + 1  # qkv, o, gate_up, down per layer; lm head
    assert {m.upcast_min_rows for m in linears} == {rows}


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
@pytest.mark.parametrize(
    ("env", "dtype", "native_bf16", "packs"),
    [
        ("auto", "float32", True, True),
        ("auto", "float32", False, True),
        ("0", "float32", True, False),
        ("auto", "bfloat16", True, True),  # native bf16 (AMX): packed, as PyTorch's compiler does
        ("auto", "bfloat16", False, False),  # emulated bf16 with the upcast turned off: left alone
        ("1", "bfloat16", True, True),
        ("0", "bfloat16", True, False),
    ],
)
def test_runner_prepacks_linear_weights_on_cpu(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    dtype: str,
    native_bf16: bool,
    packs: bool,
) -> None:
    from corral_engine.args import EngineArgs
    from corral_engine.model import runner as runner_mod
    from corral_engine.model.config import load_model_config

    has_native_bf16 = runner_mod.cpu_supports_bf16()
    monkeypatch.setenv(runner_mod.ENV_PREPACK, env)
    monkeypatch.setenv(runner_mod.ENV_UPCAST, "0")  # no bf16 upcast in the way
    monkeypatch.setattr(runner_mod, "cpu_supports_bf16", lambda: native_bf16)
    config = load_model_config(tiny_model_dir)
    runner = runner_mod.ModelRunner(config, EngineArgs(model=str(tiny_model_dir), dtype=dtype), 64)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    if dtype == "bfloat16" and not has_native_bf16:
        packs = False  # oneDNN cannot pack bf16 on this CPU: the weights stay as they are
    assert {m.packed is not None for m in linears} == {packs}
    # The tiny checkpoint's head is untied, so a packed head releases its plain copy (a tied head
    # keeps the shared one: test_rope_scaling_and_tied_embeddings runs packed in float32).
    assert not config.tie_word_embeddings
    assert (runner.model.lm_head.weight.numel() == 0) == packs


@needs_mkldnn
@pytest.mark.parametrize(
    ("env", "native_bf16", "upcast", "asks"),
    [
        ("auto", True, "auto", True),  # AMX / AVX512-BF16: bf16 weights packed by default
        ("auto", False, "auto", False),  # emulated bf16: batches run on float32 copies instead
        ("auto", False, "0", False),
        ("1", False, "0", True),
        ("0", True, "auto", False),
    ],
)
def test_runner_asks_to_pack_bf16_weights_where_the_cpu_has_native_bf16(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    native_bf16: bool,
    upcast: str,
    asks: bool,
) -> None:
    """The decision itself, on any CPU: whether oneDNN then manages to pack depends on this one."""
    from corral_engine.args import EngineArgs
    from corral_engine.model import runner as runner_mod
    from corral_engine.model.config import load_model_config

    asked: list[bool] = []
    monkeypatch.setattr(Linear, "prepack", lambda self, keep_weight: asked.append(keep_weight))
    monkeypatch.setenv(runner_mod.ENV_PREPACK, env)
    monkeypatch.setenv(runner_mod.ENV_UPCAST, upcast)
    monkeypatch.setattr(runner_mod, "cpu_supports_bf16", lambda: native_bf16)
    monkeypatch.setattr(runner_mod, "available_memory_bytes", lambda: 2**40)
    config = load_model_config(tiny_model_dir)
    runner_mod.ModelRunner(config, EngineArgs(model=str(tiny_model_dir), dtype="bfloat16"), 64)
    assert len(asked) == (4 * config.num_layers + 1 if asks else 0)


@needs_mkldnn
def test_prepacked_engine_generates_what_the_plain_one_does(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral_engine.model import runner as runner_mod
    from corral_engine.sampling_params import SamplingParams

    from tests.engine.helpers import make_engine

    prompts = [[5 + i, 9, 33 + 2 * i, 7] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for env in ("0", "auto"):
        monkeypatch.setenv(runner_mod.ENV_PREPACK, env)
        engine = make_engine(tiny_model_dir)
        is_packed = engine.runner.model.lm_head.packed is not None
        assert is_packed == (env == "auto")
        outputs[env] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
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


@needs_mkldnn
@pytest.mark.parametrize(
    ("env", "native_bf16", "available", "copies"),
    [
        ("auto", False, 2**40, True),
        ("auto", False, 2**10, False),  # the copies would not fit
        ("auto", False, None, False),
        ("1", False, 2**10, True),
        ("0", False, 2**40, False),
        ("auto", True, 2**40, False),  # native bf16: nothing is upcast
    ],
)
def test_runner_keeps_float32_copies_for_upcast_batches_when_they_fit(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    native_bf16: bool,
    available: int | None,
    copies: bool,
) -> None:
    from corral_engine.args import EngineArgs
    from corral_engine.model import runner as runner_mod
    from corral_engine.model.config import load_model_config

    monkeypatch.setenv(runner_mod.ENV_PREPACK, env)
    monkeypatch.setattr(runner_mod, "cpu_supports_bf16", lambda: native_bf16)
    monkeypatch.setattr(runner_mod, "available_memory_bytes", lambda: available)
    config = load_model_config(tiny_model_dir)
    runner = runner_mod.ModelRunner(config, EngineArgs(model=str(tiny_model_dir), dtype="bfloat16"), 64)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert {m.upcast_packed is not None for m in linears} == {copies}
    assert all(m.weight.dtype == torch.bfloat16 and m.weight.numel() > 0 for m in linears)
