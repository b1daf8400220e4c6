"""Weight quantization decided: what a checkpoint's quantization_config and --quantization ask for,
and how this device runs it (pure: no torch, no I/O; the tensor work is model/quant_ops.py).

int8/fp8 layers hold one scale per output row, so the loader quantizes each checkpoint tensor,
fused shard and tensor-parallel slice on its own; int4 checkpoints (model/quant_formats.py) keep
their own group scales and zeros. Only the dense layers' attention and MLP
projections are quantized; embeddings, the LM head and norms keep the model dtype, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corral_engine.errors import ModelLoadError
from corral_engine.model.quant_formats import INT_CHECKPOINTS, int_fields, is_int_compressed

SERVED = (
    "Corral serves fp8 checkpoints (quant_method fp8, or compressed-tensors with float8 weights and "
    "dynamic activations), int4 weight-only checkpoints (awq gemm, gptq 4/8-bit, compressed-tensors "
    "pack-quantized W4A16/W8A16) and --quantization fp8|int8 on unquantized checkpoints"
)
# fp8 matmuls (torch._scaled_mm) need Ada / Hopper or newer.
FP8_MIN_CAPABILITY = (8, 9)
# The checkpoint formats' scale tensors: `<module>.weight_scale_inv` (HF fine-grained fp8) and
# `<module>.weight_scale` (compressed-tensors); each multiplies the fp8 values it covers.
HF_FP8_SCALE = "weight_scale_inv"
COMPRESSED_SCALE = "weight_scale"


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """What is asked: `method` from --quantization ("fp8", "int8" or None), `checkpoint` the format
    the weights are stored in ("fp8", "compressed-tensors", "awq", "gptq" or None: plain); `bits`
    set for integer weight checkpoints (model/quant_formats.py)."""

    method: str | None = None
    checkpoint: str | None = None
    block_size: tuple[int, int] | None = None  # HF fp8's weight_block_size; None: per tensor or row
    scale_suffix: str = HF_FP8_SCALE
    skip: tuple[str, ...] = ()  # modules_to_not_convert / ignore: kept in the model dtype
    bits: int | None = None  # integer weights (4 or 8) packed in int32 words; None: float formats
    group_size: int = -1  # input columns sharing a scale (and zero); -1: one group per output row
    zero_point: bool = False  # asymmetric: a zero per group (else 2^(bits-1))
    desc_act: bool = False  # GPTQ act-order: g_idx may put input columns in any group
    zeros_minus_one: bool = False  # GPTQ v1 stores each zero minus one

    @property
    def is_int(self) -> bool:
        """Whether the checkpoint holds packed integer weights (AWQ, GPTQ, pack-quantized)."""
        return self.bits is not None

    def is_skipped(self, module: str) -> bool:
        """Whether checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj) stays
        unquantized: transformers' rule (a prefix to a dot, a regex from the start, or a suffix),
        and compressed-tensors' `re:` patterns."""
        for pattern in self.skip:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(pattern):
                return True
        return False

    def describe(self) -> str:
        """How the start-up log names it."""
        parts = []
        if self.is_int:
            group = "per channel" if self.group_size == -1 else f"groups of {self.group_size}"
            order = ", act-order" if self.desc_act else ""
            parts.append(f"{self.checkpoint} int{self.bits} checkpoint ({group}{order})")
        elif self.checkpoint == "fp8":
            block = "per tensor" if self.block_size is None else "blocks of {}x{}".format(*self.block_size)
            parts.append(f"fp8 checkpoint ({block})")
        elif self.checkpoint is not None:
            parts.append(f"{self.checkpoint} fp8 checkpoint")
        if self.method is not None:
            parts.append(f"--quantization {self.method}")
        return " with ".join(parts)


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """How this device runs it: the projections' weight dtype ("int8", "fp8"; None: dequantized to
    the model dtype at load) and the start-up log line saying why."""

    weights: str | None
    note: str = ""
    is_warning: bool = False


def quant_config(args_quantization: str | None, raw: Mapping[str, Any] | None) -> QuantConfig | None:
    """The quantization asked by --quantization and config.json's `raw` quantization_config, or
    None for neither; ModelLoadError for a method Corral does not serve or a contradiction."""
    if raw is None:
        if args_quantization in INT_CHECKPOINTS:
            raise ModelLoadError(
                f"--quantization {args_quantization} names a checkpoint format, but config.json has no "
                "quantization_config (give a checkpoint in that format, or --quantization int8|fp8)"
            )
        return None if args_quantization is None else QuantConfig(method=args_quantization)
    method = raw.get("quant_method")
    if method in ("awq", "gptq") or (method == "compressed-tensors" and is_int_compressed(raw)):
        found = QuantConfig(checkpoint=str(method), **int_fields(str(method), raw, SERVED))
        if args_quantization not in (None, method):
            raise ModelLoadError(
                f"--quantization {args_quantization} contradicts config.json: the checkpoint is "
                f"quantized with {method!r} (give --quantization {method}, or none)"
            )
        return found  # --quantization naming the checkpoint's own format asks for nothing more
    if method == "fp8":
        found = _hf_fp8(raw)
    elif method == "compressed-tensors":
        found = _compressed_fp8(raw)
    elif args_quantization is not None:
        raise ModelLoadError(
            f"--quantization {args_quantization} contradicts config.json: the checkpoint is already "
            f"quantized with {method!r}, which Corral cannot load; {SERVED}"
        )
    else:
        raise ModelLoadError(f"quantization method {method!r} in config.json is not supported; {SERVED}")
    if args_quantization in ("awq", "gptq") or (
        args_quantization == "compressed-tensors" and method != "compressed-tensors"
    ):
        raise ModelLoadError(
            f"--quantization {args_quantization} contradicts config.json: the checkpoint is quantized "
            f"with {method!r}"
        )
    if args_quantization == "compressed-tensors":
        return found
    return dataclasses.replace(found, method=args_quantization)


def model_quant_config(
    args_quantization: str | None, raw: Mapping[str, Any] | None, is_moe: bool
) -> QuantConfig | None:
    """quant_config, refusing mixture-of-experts models (their experts are not quantized yet)."""
    config = quant_config(args_quantization, raw)
    if config is not None and is_moe:
        raise ModelLoadError(
            f"quantization ({config.describe()}) is not supported for mixture-of-experts models yet"
        )
    return config


def plan_quant(
    config: QuantConfig | None,
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: str,
    has_int8_kernel: bool,
    has_int4_kernel: bool = True,
    int4_switch: str = "auto",
) -> QuantPlan:
    """The weights the quantized layers hold on `device_type` ("cpu", "cuda"; `capability`: the
    GPU's compute capability) for a model of `dtype` ("bfloat16", ...): int8 on CPU (it has no fp8
    matmul); fp8 on CUDA 8.9+ for bf16 models; else dequantized, with a warning when it was asked."""
    if config is None:
        return QuantPlan(None)
    what = config.describe()
    if config.is_int:
        return _plan_int(what, config.bits, device_type, dtype, has_int4_kernel, int4_switch)
    if device_type != "cuda":
        if config.method is None:
            return QuantPlan(
                None,
                f"{what}: dequantized to {dtype} at load (the CPU has no fp8 matmul; "
                "--quantization int8 runs int8 weights instead)",
            )
        how = "runs as int8 (the CPU has no fp8 matmul)" if config.method == "fp8" else "runs as int8"
        return QuantPlan("int8", f"{what}: {how}, one scale per output row (torch._weight_int8pack_mm)")
    if config.method == "int8":
        if has_int8_kernel:
            return QuantPlan(
                "int8", f"{what}: int8 weights, one scale per output row (torch._weight_int8pack_mm)"
            )
        return QuantPlan(
            None, f"{what}: PyTorch has no int8 weight kernel on this GPU: dequantized to {dtype}", True
        )
    if capability is None or capability < FP8_MIN_CAPABILITY:
        have = "?" if capability is None else "{}.{}".format(*capability)
        return QuantPlan(
            None,
            f"{what}: fp8 matmuls need compute capability 8.9+, this GPU has {have}: dequantized to {dtype}",
            True,
        )
    if dtype != "bfloat16":
        return QuantPlan(
            None, f"{what}: fp8 matmuls output bfloat16, not {dtype}: dequantized to {dtype}", True
        )
    return QuantPlan(
        "fp8",
        f"{what}: fp8 weights (a scale per row), fp8 activations (a scale per token; torch._scaled_mm)",
    )


def _plan_int(
    what: str, bits: int | None, device_type: str, dtype: str, has_int4_kernel: bool, switch: str
) -> QuantPlan:
    """Integer weight checkpoints: 4-bit ones run PyTorch's int4 kernel for bfloat16 models (CPU,
    or CUDA where it runs; `switch` CORRAL_INT4_KERNEL "1": float32 ones on the CPU too, "0":
    never); 8-bit ones and other dtypes are dequantized at load."""
    if bits != 4:
        return QuantPlan(None, f"{what}: dequantized to {dtype} at load (no {bits}-bit group kernel)")
    if switch == "0":
        return QuantPlan(None, f"{what}: dequantized to {dtype} at load (CORRAL_INT4_KERNEL=0)")
    cpu_any_dtype = switch == "1" and device_type != "cuda"
    if dtype != "bfloat16" and not cpu_any_dtype:
        why = (
            "the CPU's int4 kernel is slower than a dense matmul with float32 activations"
            if device_type != "cuda"
            else "the int4 kernel takes bfloat16 activations only"
        )
        return QuantPlan(
            None,
            f"{what}: dequantized to {dtype} at load ({why}; --dtype bfloat16 runs int4 weights, and "
            "so does CORRAL_INT4_KERNEL=1 on the CPU)",
        )
    if device_type != "cuda":
        return QuantPlan("int4", f"{what}: int4 weights (torch._weight_int4pack_mm_for_cpu)")
    if not has_int4_kernel:
        return QuantPlan(
            None, f"{what}: PyTorch's int4 kernel does not run on this GPU: dequantized to {dtype}", True
        )
    return QuantPlan("int4", f"{what}: int4 weights (torch._weight_int4pack_mm, tinygemm)")


def fp8_fits(in_features: int, out_features: int) -> bool:
    """Whether torch._scaled_mm takes a layer of this shape (both a multiple of 16)."""
    return in_features % 16 == 0 and out_features % 16 == 0


def _hf_fp8(raw: Mapping[str, Any]) -> QuantConfig:
    """transformers' FineGrainedFP8Config: fp8 weights, float32 `weight_scale_inv` per block."""
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ModelLoadError(
            f"fp8 checkpoint with activation_scheme {scheme!r}: static activation scales are not "
            "supported, only dynamic ones"
        )
    if raw.get("scale_fmt", "float") != "float":
        raise ModelLoadError(
            f"fp8 checkpoint with scale_fmt {raw['scale_fmt']!r}: only float32 scales are supported"
        )
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(
            f"fp8 checkpoint with fmt {raw['fmt']!r}: only float8 e4m3 weights are supported"
        )
    if raw.get("modules_to_convert"):
        raise ModelLoadError("fp8 checkpoint with modules_to_convert (fp8 embeddings) is not supported")
    block = raw.get("weight_block_size")
    if block is not None:
        is_pair = isinstance(block, list | tuple) and len(block) == 2
        if not is_pair or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise ModelLoadError(
                f"fp8 checkpoint: weight_block_size must be two positive integers, got {block!r}"
            )
        block = (int(block[0]), int(block[1]))
    skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    return QuantConfig(
        checkpoint="fp8", block_size=block, scale_suffix=HF_FP8_SCALE, skip=tuple(map(str, skip))
    )


def _compressed_fp8(raw: Mapping[str, Any]) -> QuantConfig:
    """compressed-tensors with float8 weights (strategy channel or tensor, `weight_scale`) and
    dynamic or no activation quantization; anything else is refused, saying what."""
    fmt = raw.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported; {SERVED}")
    if raw.get("kv_cache_scheme"):
        raise ModelLoadError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        problem = _group_problem(group)
        if problem:
            raise ModelLoadError(f"compressed-tensors group {name!r}: {problem}; {SERVED}")
    skip = raw.get("ignore") or []
    return QuantConfig(
        checkpoint="compressed-tensors", scale_suffix=COMPRESSED_SCALE, skip=tuple(map(str, skip))
    )


def _group_problem(group: Any) -> str:
    """Why one compressed-tensors scheme cannot load ("" when it can)."""
    if not isinstance(group, dict):
        return "not an object"
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        return f"{weights.get('type')} {weights.get('num_bits')}-bit weights (only float 8-bit)"
    if weights.get("strategy") not in ("channel", "tensor"):
        return f"weight strategy {weights.get('strategy')!r} (only channel or tensor)"
    if weights.get("dynamic") or weights.get("symmetric") is False:
        return "dynamic or asymmetric weight scales"
    inputs = group.get("input_activations")
    if inputs and not inputs.get("dynamic"):
        return "static activation scales (input_scale): only dynamic activations are supported"
    if group.get("output_activations"):
        return "quantized output activations"
    if "Linear" not in (group.get("targets") or []):
        return f"targets {group.get('targets')!r} (only Linear)"
    return ""
