"""How Linear layers multiply on this device: bf16 upcast, oneDNN prepacking, float32 copies.

Pure: decided from the dtype, the CPU's features and the settings, so tests cover every branch on
any CPU by passing fake CpuFeatures. The runner applies the plan to the model's Linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corral_engine.model.device import CpuFeatures
from corral_engine.settings import Switch

# bf16 matmuls of at least this many rows run in float32 where the CPU has no native bf16: PyTorch
# emulates bf16 there at a fifth of float32's speed, and below 8 rows the conversion costs more.
UPCAST_MIN_ROWS = 8
# Where bf16 is native, batches of fewer rows go through the native kernel (vdpbf16ps) and decode
# batches through the native decode stack: a decode step of 1-4 rows took 0.66-0.71x the time of
# oneDNN layer by layer, 7 rows 0.93-1.0x (small preset, AMD EPYC Zen 5, docs/engine-speed.md).
NATIVE_BF16_KERNEL_ROWS = 8


@dataclass(frozen=True, slots=True)
class MatmulPlan:
    upcast_min_rows: int  # 0: bf16 batches are multiplied in bf16 (Linear.upcast_min_rows)
    prepack: bool  # reorder weights once into oneDNN's blocked layout (Linear.prepack)
    keep_upcast_copies: bool  # keep a prepacked float32 copy for upcast batches (Linear.prepack_upcast)
    notes: tuple[str, ...] = ()  # why, for the start-up log
    # bf16 batches of fewer rows go through the native small-batch kernel (Linear.kernel_rows), which
    # reads the plain weight: a packed layer keeps it too. 0: none.
    kernel_rows: int = 0
    # bf16 layers through Corral's AMX kernel instead of oneDNN (Linear.prepack_amx), where the
    # CPU has AMX tiles and the weights are packed; layers it cannot take stay with oneDNN.
    amx_linear: bool = False


def plan_matmuls(
    dtype: torch.dtype,
    is_cpu: bool,
    cpu: CpuFeatures,
    prepack: Switch,
    bf16_upcast: Switch,
    upcast_copy_bytes: int,
    available_bytes: int | None,
    small_batch_kernel: Switch = "auto",
    amx_linear: Switch = "auto",
) -> MatmulPlan:
    """The plan for a model of `dtype` whose float32 weight copies would take `upcast_copy_bytes`.

    - Upcast (`bf16_upcast`): bf16 on a CPU without native bf16 multiplies batches of 8+ rows in
      float32 (1.3-1.9x at batch 64 on AVX2); "1" forces it, "0" never.
    - Prepack (`prepack`): float32 weights are packed by default on CPU (small preset, AVX2:
      1.13-1.37x output tok/s at batch 64, greedy output identical), and bf16 ones where the CPU
      multiplies bf16 natively (AVX512-BF16: 1.15x, docs/engine-speed.md), as PyTorch's compiler
      and vLLM's CPU build do there; "1" packs whatever oneDNN can, "0" nothing.
    - Float32 copies: where bf16 batches are upcast, a packed float32 copy of each weight instead
      of a conversion per call (that conversion was 28% of a batch-64 step); "auto" keeps them
      when they take at most a quarter of the memory available now.
    - Small batches (`small_batch_kernel`): bf16 batches of fewer than 8 rows go through the
      native kernel where bf16 is upcast ("auto"; PyTorch's emulated bf16 matmul is slow there);
      where bf16 is native, those batches too ("auto", and model/decode_stack.py runs their
      decodes in one native call), when the plain bf16 weights the kernel reads, kept beside the
      packed ones (half of `upcast_copy_bytes`), take at most a quarter of the memory available
      now; "1": also where they would not fit, "0": never (an A/B against oneDNN or PyTorch).
    - AMX (`amx_linear`): where bf16 weights are packed on a CPU with AMX tiles, they are packed
      for Corral's AMX kernel instead of oneDNN ("auto" and "1"; 1.07-1.19x a step on two
      Sapphire Rapids cores, docs/engine-speed.md); "0": oneDNN.
    """
    if not is_cpu or not cpu.has_onednn:
        prepack = "0"  # oneDNN packs only CPU weights
    upcast_rows = _upcast_rows(dtype, is_cpu, cpu, bf16_upcast)
    notes: list[str] = []
    if upcast_rows:
        notes.append(f"bf16 matmuls of {upcast_rows}+ rows run in float32 (no native bf16 on this CPU)")
    copies = False
    if upcast_rows and prepack != "0":
        mib = upcast_copy_bytes >> 20
        fits = available_bytes is not None and upcast_copy_bytes <= available_bytes // 4
        copies = prepack == "1" or fits
        notes.append(
            f"bf16 Linear weights also kept in float32 for upcast batches ({mib} MiB)"
            if copies
            else f"bf16 weights are converted per batch: a float32 copy ({mib} MiB) would not fit"
        )
    packs = _prepacks(dtype, cpu, prepack, upcast_rows)
    plain_bytes = upcast_copy_bytes // 2  # the bf16 weights the kernel reads, beside packed ones
    plain_fits = not packs or (available_bytes is not None and plain_bytes <= available_bytes // 4)
    wanted = _kernel_rows(dtype, is_cpu, cpu, small_batch_kernel, upcast_rows)
    kernel_rows = wanted if plain_fits or small_batch_kernel == "1" else 0
    if kernel_rows and not upcast_rows:
        kept = f"plain weights kept, {plain_bytes >> 20} MiB" if packs else "plain weights"
        notes.append(f"bf16 matmuls of fewer than {kernel_rows} rows through the native kernel ({kept})")
    elif wanted and not kernel_rows:
        mib = plain_bytes >> 20
        notes.append(f"bf16 matmuls of every size through oneDNN: plain weights ({mib} MiB) would not fit")
    amx = packs and is_cpu and dtype == torch.bfloat16 and cpu.has_amx and amx_linear != "0"
    return MatmulPlan(upcast_rows, packs, copies, tuple(notes), kernel_rows, amx)


def _kernel_rows(dtype: torch.dtype, is_cpu: bool, cpu: CpuFeatures, mode: Switch, upcast_rows: int) -> int:
    """Rows below which bf16 batches would take the native kernel, memory aside."""
    if dtype != torch.bfloat16 or not is_cpu or mode == "0":
        return 0
    if upcast_rows:  # emulated bf16: below the upcast
        return upcast_rows
    return NATIVE_BF16_KERNEL_ROWS if mode == "1" or cpu.has_native_bf16 else 0


def _upcast_rows(dtype: torch.dtype, is_cpu: bool, cpu: CpuFeatures, mode: Switch) -> int:
    if dtype != torch.bfloat16 or not is_cpu or mode == "0":
        return 0
    if mode == "auto" and cpu.has_native_bf16:
        return 0
    return UPCAST_MIN_ROWS


def _prepacks(dtype: torch.dtype, cpu: CpuFeatures, mode: Switch, upcast_rows: int) -> bool:
    if mode == "0":
        return False
    if dtype == torch.bfloat16 and upcast_rows:
        return False  # bf16 batches are multiplied in float32 here; a bf16 packing would not apply
    if mode == "1" or dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and cpu.has_native_bf16
