"""Where the model runs: device and dtype choice, and what this CPU can do (probed once)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from corral_engine.errors import ModelLoadError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """The CPU capabilities that change the engine's code paths. Tests fake them to cover every
    branch on any machine (see README, Testing)."""

    has_native_bf16: bool  # AVX512-BF16 or AMX: oneDNN multiplies bf16 natively (else emulates it)
    has_onednn: bool  # this torch has oneDNN (mkldnn), which prepacks Linear weights
    has_amx: bool = False  # AMX tiles (amx_bf16): Corral's AMX Linear kernel can run here


@cache
def probe_cpu() -> CpuFeatures:
    """This machine's CpuFeatures, as PyTorch's oneDNN sees them."""
    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = False
    return CpuFeatures(
        has_native_bf16=native_bf16,
        has_onednn=torch.backends.mkldnn.is_available(),
        has_amx=_has_cpu_flag("amx_bf16"),
    )


def _has_cpu_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (Linux; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def select_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(requested)
    except RuntimeError as e:
        raise ModelLoadError(f"invalid device {requested!r}: {e}") from e


def select_dtype(
    requested: str, device: torch.device, checkpoint_dtype: str | None, cpu: CpuFeatures
) -> torch.dtype:
    """The explicit dtype, else: on CUDA the checkpoint's half type (bf16 where supported); on CPU
    bf16 where the CPU has native bf16, else float32."""
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cuda":
        if checkpoint_dtype in ("bfloat16", "float16"):
            return _DTYPES[checkpoint_dtype]
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu.has_native_bf16 else torch.float32


def available_memory_bytes() -> int | None:
    """Memory the kernel could give this process now (MemAvailable), if it says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
