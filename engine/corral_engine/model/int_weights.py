"""Integer weight-only checkpoints loaded: each quantized module's packed tensors (AWQ and GPTQ
qweight, qzeros, scales, g_idx; compressed-tensors weight_packed, weight_scale, weight_shape,
weight_zero_point, weight_g_idx) read together, unpacked, cut for this rank and put in place:
int4 layers take the values, plain ones (and whole groups a rank cannot keep) the dequantization."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from corral_engine.errors import ModelLoadError
from corral_engine.model.int4_ops import IntWeight, pack_nibbles, unpack_awq, unpack_compressed, unpack_gptq
from corral_engine.model.llama import FusedLinear, Linear
from corral_engine.model.parallel import ShardPlan
from corral_engine.model.quant import QuantConfig

logger = logging.getLogger("corral_engine.model.loader")

PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_shape",
        "weight_zero_point",
        "weight_g_idx",
    ),
}
_REQUIRED = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape"),
}
# The dense projections an integer checkpoint holds packed, unless it lists them as not converted.
_PROJECTION = re.compile(r"\.(?:self_attn\.(?:[qkvo]|qkv)_proj|mlp\.(?:gate|up|down|gate_up)_proj)\.weight$")
_FUSED_SHARDS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def is_int_part(name: str, quant: QuantConfig) -> bool:
    """Whether checkpoint tensor `name` is one of a quantized module's packed parts."""
    return quant.checkpoint in PARTS and name.rsplit(".", 1)[-1] in PARTS[str(quant.checkpoint)]


def check_plain(name: str, quant: QuantConfig) -> None:
    """Refuse plain weights where the checkpoint's config says its layers are packed integers."""
    if (
        _PROJECTION.search(name)
        and ".experts." not in name
        and not quant.is_skipped(name.removesuffix(".weight"))
    ):
        raise ModelLoadError(
            f"tensor {name!r} holds plain weights, but config.json's quantization_config "
            f"({quant.checkpoint}) quantizes that module and does not list it as not converted"
        )


def int_modules(files: list[Path], quant: QuantConfig) -> dict[str, dict[str, Path]]:
    """Each quantized checkpoint module -> its parts -> the file holding each."""
    found: dict[str, dict[str, Path]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if is_int_part(name, quant):
                    module, part = name.rsplit(".", 1)
                    found.setdefault(module, {})[part] = file
    return found


def read_int_weight(module: str, parts: dict[str, Path], quant: QuantConfig) -> IntWeight:
    """One module's parts read whole and unpacked (q [out, in], scale and zero [out, groups])."""
    checkpoint = str(quant.checkpoint)
    missing = [p for p in _REQUIRED[checkpoint] if p not in parts]
    if missing:
        raise ModelLoadError(f"quantized module {module!r} has no {', '.join(missing)} in the checkpoint")
    tensors = {}
    for part, file in parts.items():
        with safe_open(str(file), framework="pt") as f:
            tensors[part] = f.get_tensor(f"{module}.{part}")
    bits = quant.bits or 4
    try:
        if checkpoint == "awq":
            return unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], quant.group_size)
        if checkpoint == "gptq":
            return unpack_gptq(
                tensors["qweight"],
                tensors["qzeros"],
                tensors["scales"],
                tensors.get("g_idx"),
                bits,
                quant.zeros_minus_one,
            )
        shape = tensors["weight_shape"].tolist()
        return unpack_compressed(
            tensors["weight_packed"],
            tensors["weight_scale"],
            (int(shape[0]), int(shape[1])),
            tensors.get("weight_zero_point"),
            tensors.get("weight_g_idx"),
            bits,
        )
    except (RuntimeError, IndexError, ValueError) as e:
        raise ModelLoadError(f"quantized module {module!r}: its {checkpoint} tensors do not fit: {e}") from e


def load_int_weights(
    files: list[Path],
    quant: QuantConfig,
    rename: Callable[[str], str | None],
    plan: ShardPlan | None,
    modules: dict[str, torch.nn.Module],
    dtype: torch.dtype,
) -> set[str]:
    """Fill the layers of every quantized checkpoint module (this rank's part); the loaded keys
    (as load_weights names them: `fused.weight:shard` for a fused layer's shard)."""
    loaded: set[str] = set()
    dequantized: list[str] = []
    for module, parts in int_modules(files, quant).items():
        name = rename(module + ".weight")
        if name is None:
            continue
        layer, shard, key = _destination(name, modules)
        offset, size = (0, layer.out_features)
        if isinstance(layer, FusedLinear) and shard:
            offset, size = layer.shard_offsets[shard]
        weight = read_int_weight(module, parts, quant)
        cut = None if plan is None else plan.checkpoint_slice(name)
        weight = weight.cut(None if isinstance(cut, bool) else cut)
        if tuple(weight.q.shape) != (size, layer.in_features):
            raise ModelLoadError(
                f"quantized module {module!r} unpacks to {tuple(weight.q.shape)}, the config implies "
                f"{(size, layer.in_features)}"
            )
        with torch.no_grad():
            if not _fill_int4(layer, offset, weight, dtype, module, dequantized):
                layer.weight[offset : offset + size].copy_(weight.dequantized())
        loaded.add(key)
    if dequantized:
        logger.info(
            "%d int4 layers dequantized to %s at load (act-order groups, or a tensor-parallel cut "
            "mid-group): %s",
            len(dequantized),
            str(dtype).removeprefix("torch."),
            ", ".join(dequantized[:4]) + (" ..." if len(dequantized) > 4 else ""),
        )
    return loaded


def _fill_int4(
    layer: Linear, offset: int, weight: IntWeight, dtype: torch.dtype, module: str, dequantized: list[str]
) -> bool:
    """Put `weight` in an int4 layer's rows from `offset`; False when the layer is plain, or had
    to become plain (groups not whole and in order here) and the caller writes the dequantization."""
    if layer.quant != "int4":
        return False
    groups = weight.contiguous_groups(layer.group_size)
    if groups is None:
        layer.unquantize(dtype)
        dequantized.append(module)
        return False
    rows = slice(offset, offset + weight.q.shape[0])
    layer.weight[rows].copy_(pack_nibbles(weight.q))
    layer.get_buffer("weight_scale")[rows].copy_(groups[0])
    layer.get_buffer("weight_zero")[rows].copy_(groups[1])
    return True


def _destination(name: str, modules: dict[str, torch.nn.Module]) -> tuple[Linear, str, str]:
    """Engine weight `name` -> (the Linear holding it, its shard of a fused layer or "", the key)."""
    parent, holder = name.rsplit(".", 2)[:2]
    for fused, shards in _FUSED_SHARDS.items():
        if holder in shards:
            layer = modules.get(f"{parent}.{fused}")
            if isinstance(layer, FusedLinear):
                return layer, holder, f"{parent}.{fused}.weight:{holder}"
    layer = modules.get(f"{parent}.{holder}")
    if not isinstance(layer, Linear):
        raise ModelLoadError(
            f"quantized tensors for {name.removesuffix('.weight')!r}, which is not a Linear layer"
        )
    return layer, "", name
