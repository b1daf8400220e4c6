"""Integer weight-only checkpoint formats read from config.json's quantization_config (pure: no
torch): AWQ (GEMM layout), GPTQ (v1 and v2 zeros) and compressed-tensors pack-quantized (W4A16,
W8A16). Each becomes the int fields of a `QuantConfig`; anything else is refused saying what."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from corral_engine.errors import ModelLoadError

# The formats whose `checkpoint` holds packed integer weights with group scales (and zeros).
INT_CHECKPOINTS = ("awq", "gptq", "compressed-tensors")


def int_fields(method: str, raw: Mapping[str, Any], served: str) -> dict[str, Any]:
    """The QuantConfig fields of an AWQ, GPTQ or pack-quantized compressed-tensors checkpoint;
    ModelLoadError (ending in `served`) for a variant Corral cannot load."""
    if method == "awq":
        return _awq(raw, served)
    if method == "gptq":
        return _gptq(raw, served)
    return _pack_quantized(raw, served)


def _group_size(value: Any, what: str) -> int:
    """A checkpoint's group size: a positive int, or -1 for one group per output row."""
    if value is None:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or (value <= 0 and value != -1):
        raise ModelLoadError(f"{what} checkpoint: group_size must be a positive integer or -1, got {value!r}")
    return int(value)


def _awq(raw: Mapping[str, Any], served: str) -> dict[str, Any]:
    """AutoAWQ's GEMM layout: qweight [in, out/8], qzeros [in/G, out/8], scales [in/G, out]."""
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"AWQ checkpoint version {version!r} is not supported (only gemm); {served}")
    if raw.get("bits", raw.get("w_bit")) != 4:
        raise ModelLoadError(f"AWQ checkpoint with {raw.get('bits')} bits: only 4-bit is supported; {served}")
    if raw.get("zero_point", True) is not True:
        raise ModelLoadError("AWQ checkpoint without zero points is not supported (only zero_point true)")
    group = _group_size(raw.get("group_size", raw.get("q_group_size", 128)), "AWQ")
    skip = raw.get("modules_to_not_convert") or []
    return {"bits": 4, "group_size": group, "zero_point": True, "skip": tuple(map(str, skip))}


def _gptq(raw: Mapping[str, Any], served: str) -> dict[str, Any]:
    """AutoGPTQ / GPTQModel: qweight [in/8, out], qzeros [in/G, out/8] (v1: z - 1), scales
    [in/G, out], g_idx [in]."""
    bits = raw.get("bits")
    if bits not in (4, 8):
        raise ModelLoadError(f"GPTQ checkpoint with {bits} bits: only 4 and 8 are supported; {served}")
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2") or raw.get("is_marlin_format"):
        raise ModelLoadError(
            f"GPTQ checkpoint_format {raw.get('checkpoint_format')!r} is not supported "
            "(only gptq and gptq_v2)"
        )
    if raw.get("dynamic"):
        raise ModelLoadError("GPTQ checkpoint with per-module `dynamic` overrides is not supported")
    if raw.get("lm_head"):
        raise ModelLoadError("GPTQ checkpoint with a quantized lm_head is not supported")
    return {
        "bits": int(bits),
        "group_size": _group_size(raw.get("group_size", -1), "GPTQ"),
        "zero_point": True,  # symmetric GPTQ stores its zeros (8 for 4-bit) all the same
        "desc_act": bool(raw.get("desc_act", False)),
        "zeros_minus_one": fmt == "gptq",
        "skip": tuple(map(str, raw.get("modules_to_not_convert") or [])),
    }


def _pack_quantized(raw: Mapping[str, Any], served: str) -> dict[str, Any]:
    """compressed-tensors `pack-quantized` (llm-compressor's W4A16 / W8A16): weight_packed
    [out, in*bits/32], weight_scale [out, in/G], asymmetric: weight_zero_point [out*bits/32, in/G]."""
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("compressed-tensors quantization_config has no config_groups")
    if raw.get("kv_cache_scheme"):
        raise ModelLoadError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported")
    schemes = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        problem = _int_group_problem(group, weights)
        if problem:
            raise ModelLoadError(f"compressed-tensors group {name!r}: {problem}; {served}")
        weights = cast("dict[str, Any]", weights)  # _int_group_problem checked it
        strategy = weights.get("strategy")
        size = _group_size(weights.get("group_size"), "compressed-tensors") if strategy == "group" else -1
        schemes.add((int(weights["num_bits"]), size, bool(weights.get("symmetric", True))))
    if len(schemes) != 1:
        raise ModelLoadError("compressed-tensors groups with different weight schemes are not supported")
    bits, size, symmetric = schemes.pop()
    return {
        "bits": bits,
        "group_size": size,
        "zero_point": not symmetric,
        "skip": tuple(map(str, raw.get("ignore") or [])),
    }


def is_int_compressed(raw: Mapping[str, Any]) -> bool:
    """Whether a compressed-tensors config holds packed integer weights (pack-quantized)."""
    if raw.get("format") == "pack-quantized":
        return True
    groups = raw.get("config_groups") or {}
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and g.get("format") == "pack-quantized" for g in groups.values()
    )


def _int_group_problem(group: Any, weights: Any) -> str:
    """Why one pack-quantized scheme cannot load ("" when it can)."""
    if not isinstance(group, dict) or not isinstance(weights, dict):
        return "not an object with weights"
    if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
        return f"{weights.get('type')} {weights.get('num_bits')}-bit weights (only int 4-bit and 8-bit)"
    if weights.get("strategy") not in ("group", "channel"):
        return f"weight strategy {weights.get('strategy')!r} (only group or channel)"
    if weights.get("dynamic"):
        return "dynamic weight scales"
    if group.get("input_activations") or group.get("output_activations"):
        return "quantized activations (only weight-only W4A16 / W8A16)"
    if "Linear" not in (group.get("targets") or []):
        return f"targets {group.get('targets')!r} (only Linear)"
    return ""
