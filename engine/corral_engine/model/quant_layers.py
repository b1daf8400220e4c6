"""Which of a model's Linear layers hold quantized weights, set up before loading (model/quant.py
decides the kind; the loader fills them)."""

from __future__ import annotations

from typing import cast

import torch

from corral_engine.model.int4_ops import int4_fits
from corral_engine.model.llama import MLP, CausalLM, DecoderLayer, FusedLinear, Linear
from corral_engine.model.quant import QuantConfig, fp8_fits


def quantize_layers(model: CausalLM, kind: str, config: QuantConfig) -> tuple[list[Linear], list[str]]:
    """Make the dense layers' attention and MLP projections hold `kind` ("int8", "fp8", "int4")
    weights, on the meta device; (those layers, why others stay in the model dtype). A fused layer
    stays whole when the checkpoint keeps any of its shards unquantized (modules_to_not_convert)."""
    quantized: list[Linear] = []
    kept: list[str] = []
    for i, layer in enumerate(cast("list[DecoderLayer]", list(model.model.layers))):
        attn = layer.self_attn
        holders: list[tuple[str, Linear]] = [("self_attn", attn.qkv_proj), ("self_attn", attn.o_proj)]
        if isinstance(layer.mlp, MLP):  # experts are never quantized (refused with quantization)
            holders += [("mlp", layer.mlp.gate_up_proj), ("mlp", layer.mlp.down_proj)]
        for block, linear in holders:
            names = _checkpoint_names(i, block, linear)
            if any(config.is_skipped(n) for n in names):
                kept.append(f"{names[0]} (modules_to_not_convert)")
            elif kind == "fp8" and not fp8_fits(linear.in_features, linear.out_features):
                kept.append(
                    f"{names[0]} ({linear.out_features}x{linear.in_features}: fp8 needs multiples of 16)"
                )
            elif kind == "int4" and not int4_fits(linear.in_features, linear.out_features, config.group_size):
                kept.append(
                    f"{names[0]} ({linear.out_features}x{linear.in_features}, groups of {config.group_size}: "
                    "the int4 kernel needs whole groups of 32-256 and outputs a multiple of 16; dequantized)"
                )
            else:
                linear.quantize(kind, config.group_size)
                quantized.append(linear)
    return quantized, kept


def quantized_bytes(layers: list[Linear]) -> int:
    """The quantized layers' weights and scales (int4: and zeros) in bytes, once ready."""
    total = 0
    for lin in layers:
        scale = lin.kernel_scale if lin.quant == "int4" else lin.get_buffer("weight_scale")
        total += lin.weight.nbytes + (0 if scale is None else scale.nbytes)
    return total


def ready(layers: list[Linear], dtype: torch.dtype) -> None:
    for linear in layers:
        linear.quantized_ready(dtype)


def _checkpoint_names(layer: int, block: str, linear: Linear) -> list[str]:
    """The checkpoint modules whose weights fill `linear` (q/k/v for the fused qkv_proj)."""
    prefix = f"model.layers.{layer}.{block}."
    if isinstance(linear, FusedLinear):
        return [prefix + shard for shard in linear.shard_offsets]
    name = "o_proj" if block == "self_attn" else "down_proj"
    return [prefix + name]


def describe_quantized(layers: list[Linear], kept: list[str], dtype: torch.dtype) -> str:
    """The start-up log line: what is quantized, its memory against the model dtype, what is not."""
    mib = quantized_bytes(layers) / (1 << 20)
    plain = sum(lin.in_features * lin.out_features for lin in layers) * dtype.itemsize / (1 << 20)
    line = (
        f"{len(layers)} Linear layers quantized: {mib:.1f} MiB of weights and scales ({plain:.1f} MiB in "
        f"{str(dtype).removeprefix('torch.')}); no prepacking, float32 upcast, native bf16 kernel or "
        "native decode stack for them"
    )
    if kept:
        more = f" and {len(kept) - 4} more" if len(kept) > 4 else ""
        line += f"; kept in the model dtype: {', '.join(kept[:4])}{more}"
    return line
