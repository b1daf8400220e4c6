"""Which matmul path the engine takes on which CPU (bf16 upcast, oneDNN prepacking, float32 copies).

The decision is pure (`plan_matmuls`), so every branch is covered here on any machine by faking the
CPU's features; the runner tests then check the plan is applied, with fake features and with this
machine's own, and derive what to expect from the same plan rather than from the CPU they run on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from corral_engine.args import EngineArgs
from corral_engine.model import builder as builder_mod
from corral_engine.model import runner as runner_mod
from corral_engine.model.config import load_model_config
from corral_engine.model.device import CpuFeatures, probe_cpu, select_dtype
from corral_engine.model.llama import Linear
from corral_engine.model.matmul_plan import NATIVE_BF16_KERNEL_ROWS, UPCAST_MIN_ROWS, MatmulPlan, plan_matmuls
from corral_engine.model.native import load_amx_linear, load_fused_ops
from corral_engine.settings import EngineSettings, Switch

NATIVE = CpuFeatures(has_native_bf16=True, has_onednn=True)  # AVX512-BF16 or AMX
EMULATED = CpuFeatures(has_native_bf16=False, has_onednn=True)  # AVX2 (bf16 emulated by oneDNN)
NO_ONEDNN = CpuFeatures(has_native_bf16=False, has_onednn=False)
AMX = CpuFeatures(has_native_bf16=True, has_onednn=True, has_amx=True)  # Sapphire Rapids and later
BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
FITS, TIGHT = 2**40, 2**10  # memory available now: plenty / not enough for float32 copies
CPUS = {"native": NATIVE, "emulated": EMULATED, "no-onednn": NO_ONEDNN, "amx": AMX}


def _plan(
    dtype: torch.dtype,
    cpu: CpuFeatures,
    prepack: Switch = "auto",
    upcast: Switch = "auto",
    available: int | None = FITS,
    is_cpu: bool = True,
    small: Switch = "auto",
) -> MatmulPlan:
    return plan_matmuls(
        dtype,
        is_cpu,
        cpu,
        prepack,
        upcast,
        upcast_copy_bytes=2**20,
        available_bytes=available,
        small_batch_kernel=small,
    )


@pytest.mark.parametrize(
    ("dtype", "cpu", "prepack", "amx", "is_cpu", "expected"),
    [
        (BF16, AMX, "auto", "auto", True, True),
        (BF16, AMX, "auto", "1", True, True),
        (BF16, AMX, "auto", "0", True, False),  # switched off: oneDNN
        (BF16, AMX, "0", "auto", True, False),  # nothing packed, nothing for the kernel either
        (F32, AMX, "auto", "auto", True, False),  # bf16 only
        (BF16, NATIVE, "auto", "auto", True, False),  # AVX512-BF16 without tiles
        (BF16, AMX, "auto", "auto", False, False),  # never on a GPU
    ],
)
def test_amx_linear(
    dtype: torch.dtype, cpu: CpuFeatures, prepack: Switch, amx: Switch, is_cpu: bool, expected: bool
) -> None:
    plan = plan_matmuls(dtype, is_cpu, cpu, prepack, "auto", 2**20, FITS, amx_linear=amx)
    assert plan.amx_linear == expected


@pytest.mark.parametrize(
    ("dtype", "cpu", "upcast", "is_cpu", "rows"),
    [
        (BF16, EMULATED, "auto", True, UPCAST_MIN_ROWS),  # emulated bf16: large batches in float32
        (BF16, NATIVE, "auto", True, 0),  # native bf16 multiplies bf16 itself
        (BF16, NATIVE, "1", True, UPCAST_MIN_ROWS),
        (BF16, EMULATED, "0", True, 0),
        (F32, EMULATED, "1", True, 0),  # only bf16 is ever upcast
        (F16, EMULATED, "auto", True, 0),
        (BF16, EMULATED, "1", False, 0),  # never on a GPU
    ],
)
def test_upcast(dtype: torch.dtype, cpu: CpuFeatures, upcast: Switch, is_cpu: bool, rows: int) -> None:
    assert _plan(dtype, cpu, upcast=upcast, is_cpu=is_cpu).upcast_min_rows == rows


@pytest.mark.parametrize(
    ("dtype", "cpu", "upcast", "small", "is_cpu", "rows"),
    [
        (BF16, EMULATED, "auto", "auto", True, UPCAST_MIN_ROWS),  # below the upcast: the kernel
        (BF16, NATIVE, "auto", "auto", True, NATIVE_BF16_KERNEL_ROWS),  # vdpbf16ps
        (BF16, NATIVE, "auto", "1", True, NATIVE_BF16_KERNEL_ROWS),
        (BF16, NATIVE, "auto", "0", True, 0),  # the A/B: oneDNN for every size
        (BF16, EMULATED, "auto", "0", True, 0),
        (BF16, EMULATED, "0", "auto", True, 0),  # nothing upcast: PyTorch's bf16 for every size
        (F32, EMULATED, "auto", "1", True, 0),  # a bf16 kernel
        (BF16, NATIVE, "auto", "1", False, 0),  # never on a GPU
    ],
)
def test_small_batch_kernel(
    dtype: torch.dtype, cpu: CpuFeatures, upcast: Switch, small: Switch, is_cpu: bool, rows: int
) -> None:
    plan = _plan(dtype, cpu, upcast=upcast, is_cpu=is_cpu, small=small)
    assert plan.kernel_rows == rows
    assert any("native kernel" in note for note in plan.notes) == bool(rows and not plan.upcast_min_rows)


@pytest.mark.parametrize(
    ("prepack", "small", "available", "rows"),
    [
        ("auto", "auto", FITS, NATIVE_BF16_KERNEL_ROWS),
        ("auto", "auto", TIGHT, 0),  # plain copies beside the packed weights would not fit: oneDNN
        ("auto", "auto", None, 0),  # memory unknown: nothing extra
        ("0", "auto", TIGHT, NATIVE_BF16_KERNEL_ROWS),  # nothing packed: the plain weights are all there is
        ("auto", "1", TIGHT, NATIVE_BF16_KERNEL_ROWS),  # asked for: kept whatever they take
    ],
)
def test_native_bf16_small_batches_keep_plain_weights_only_where_they_fit(
    prepack: Switch, small: Switch, available: int | None, rows: int
) -> None:
    plan = _plan(BF16, NATIVE, prepack=prepack, available=available, small=small)
    assert plan.kernel_rows == rows
    assert any("would not fit" in note for note in plan.notes) == (rows == 0)


@pytest.mark.parametrize(
    ("dtype", "cpu", "prepack", "upcast", "is_cpu", "packs"),
    [
        (F32, NATIVE, "auto", "auto", True, True),  # float32: packed on every CPU
        (F32, EMULATED, "auto", "auto", True, True),
        (F32, EMULATED, "0", "auto", True, False),
        (BF16, NATIVE, "auto", "auto", True, True),  # native bf16: packed, as PyTorch's compiler does
        (BF16, EMULATED, "auto", "0", True, False),  # emulated bf16, no upcast: left alone
        (BF16, EMULATED, "1", "0", True, True),  # "1" packs whatever oneDNN can
        (BF16, NATIVE, "0", "auto", True, False),
        (BF16, EMULATED, "1", "auto", True, False),  # upcast batches use float32 copies instead
        (BF16, NATIVE, "1", "1", True, False),
        (F16, NATIVE, "auto", "auto", True, False),
        (F16, NATIVE, "1", "auto", True, True),
        (F32, NO_ONEDNN, "1", "auto", True, False),  # nothing packs without oneDNN
        (F32, NATIVE, "1", "auto", False, False),  # nor off the CPU
    ],
)
def test_prepack(
    dtype: torch.dtype, cpu: CpuFeatures, prepack: Switch, upcast: Switch, is_cpu: bool, packs: bool
) -> None:
    assert _plan(dtype, cpu, prepack, upcast, is_cpu=is_cpu).prepack is packs


@pytest.mark.parametrize(
    ("cpu", "prepack", "upcast", "available", "copies"),
    [
        (EMULATED, "auto", "auto", FITS, True),
        (EMULATED, "auto", "auto", TIGHT, False),  # would not fit in a quarter of what is free
        (EMULATED, "auto", "auto", None, False),  # unknown: do not risk it
        (EMULATED, "1", "auto", TIGHT, True),
        (EMULATED, "0", "auto", FITS, False),
        (NATIVE, "auto", "auto", FITS, False),  # nothing is upcast
        (NATIVE, "auto", "1", FITS, True),
        (NO_ONEDNN, "auto", "auto", FITS, False),  # the copies are oneDNN-packed
    ],
)
def test_float32_copies(
    cpu: CpuFeatures, prepack: Switch, upcast: Switch, available: int | None, copies: bool
) -> None:
    plan = _plan(BF16, cpu, prepack, upcast, available)
    assert plan.keep_upcast_copies is copies
    assert any("float32" in note for note in plan.notes) == bool(plan.upcast_min_rows)


@pytest.mark.parametrize(("cpu", "dtype"), [(NATIVE, BF16), (EMULATED, F32), (NO_ONEDNN, F32)])
def test_auto_dtype_on_cpu_is_bf16_only_where_it_is_native(cpu: CpuFeatures, dtype: torch.dtype) -> None:
    assert select_dtype("auto", torch.device("cpu"), "bfloat16", cpu) == dtype
    assert select_dtype("float32", torch.device("cpu"), "bfloat16", cpu) == F32


def _runner(
    model_dir: Path, dtype: str, settings: EngineSettings, cpu: CpuFeatures | None
) -> runner_mod.ModelRunner:
    config = load_model_config(model_dir)
    return runner_mod.ModelRunner(config, EngineArgs(model=str(model_dir), dtype=dtype), 64, settings, cpu)


def _assert_applies(runner: runner_mod.ModelRunner, asked: MatmulPlan) -> None:
    """The Linear layers carry `asked`; prepacking may fall back (oneDNN refuses bf16 packing on
    some CPUs without native bf16), and the runner's plan then says what was done."""
    done = runner.matmul_plan
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * runner.config.num_layers + 1  # qkv, o, gate_up, down per layer; head
    assert {m.upcast_min_rows for m in linears} == {asked.upcast_min_rows}
    assert {m.upcast_packed is not None for m in linears} == {asked.keep_upcast_copies}
    # Small bf16 batches go through the native kernel where the plan says (if it built).
    assert {m.kernel_rows for m in linears} == {asked.kernel_rows}
    has_kernel = asked.kernel_rows > 0 and load_fused_ops(runner.settings) is not None
    assert {m.fused_ops is not None for m in linears} == {has_kernel}
    # Packed for oneDNN, or for the AMX kernel where the plan says so and it built (every layer of
    # the tiny checkpoint has sizes the kernel takes).
    on_amx = asked.amx_linear and load_amx_linear(runner.settings) is not None
    assert done.amx_linear == on_amx
    assert {m.amx_packed is not None for m in linears} == {on_amx}
    assert {m.packed is not None or m.amx_packed is not None for m in linears} == {done.prepack}
    assert done.prepack == asked.prepack or (asked.prepack and runner.dtype == BF16)
    if runner.dtype == F32 or probe_cpu().has_native_bf16:
        assert done.prepack == asked.prepack  # oneDNN packs these on this CPU
    # The tiny checkpoint's head is untied, so a packed head releases its plain copy.
    assert not runner.config.tie_word_embeddings
    for m in linears:  # the kernel reads the plain weight, so a packed layer keeps it then
        is_packed = m.packed is not None or m.amx_packed is not None
        assert (m.weight.numel() == 0) == (is_packed and not asked.kernel_rows)
        assert is_packed or m.weight.dtype == runner.dtype


@pytest.mark.parametrize("cpu", CPUS.values(), ids=CPUS.keys())
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    ("prepack", "upcast", "small"),
    [
        ("auto", "auto", "auto"),
        ("0", "auto", "auto"),
        ("1", "0", "auto"),
        ("auto", "1", "auto"),
        ("auto", "auto", "1"),
    ],
)
def test_runner_applies_the_plan_for_faked_cpus(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpu: CpuFeatures,
    dtype: str,
    prepack: Switch,
    upcast: Switch,
    small: Switch,
) -> None:
    monkeypatch.setattr(builder_mod, "available_memory_bytes", lambda: FITS)
    settings = EngineSettings(prepack=prepack, bf16_upcast=upcast, small_batch_kernel=small)
    runner = _runner(tiny_model_dir, dtype, settings, cpu)
    assert runner.cpu is cpu
    _assert_applies(runner, _plan(runner.dtype, cpu, prepack, upcast, small=small))


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_runner_follows_this_cpus_probe(tiny_model_dir: Path, dtype: str) -> None:
    """No fakes: whatever this CPU is, the runner takes the path the plan gives for its probe."""
    runner = _runner(tiny_model_dir, dtype, EngineSettings(prepack="auto", bf16_upcast="auto"), None)
    cpu = probe_cpu()
    assert runner.cpu == cpu
    assert runner.dtype == (BF16 if dtype == "bfloat16" or cpu.has_native_bf16 else F32)
    available = builder_mod.available_memory_bytes()
    _assert_applies(runner, _plan(runner.dtype, cpu, "auto", "auto", available))
