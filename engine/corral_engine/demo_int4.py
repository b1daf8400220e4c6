"""Turn a written demo checkpoint into an int4 weight-only one, as the quantization tools write
them: AutoAWQ's GEMM layout ("awq"), AutoGPTQ's v1 layout ("gptq", symmetric; `act_order` gives a
random g_idx, as desc_act does) or llm-compressor's compressed-tensors pack-quantized W4A16
("w4a16", symmetric). Values come from round-to-nearest group quantization of the same weights.
The packers here are written from each format's documented rule, apart from the engine's readers."""

from __future__ import annotations

import pathlib
import re
from typing import Any

from corral_engine.demo_fp8 import rewrite_projections

FORMATS = ("awq", "gptq", "w4a16")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output column 8c + AWQ_ORDER[i]
_PROJECTION = re.compile(r"\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")


def group_size_for(in_dims: list[int]) -> int:
    """The largest of 128, 64, 32 such that every projection's input splits into whole groups on
    each of two tensor-parallel ranks."""
    return next((g for g in (128, 64, 32) if all(d % (2 * g) == 0 for d in in_dims)), 32)


def quantization_config(fmt: str, group_size: int, act_order: bool = False) -> dict[str, Any]:
    """config.json's quantization_config as AutoAWQ, AutoGPTQ (via optimum) and llm-compressor write it."""
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "damp_percent": 0.01,
            "desc_act": act_order,
            "static_groups": False,
            "sym": True,
            "true_sequential": True,
            "model_name_or_path": None,
            "model_file_base_name": "model",
            "checkpoint_format": "gptq",
        }
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "group_size": group_size,
        "strategy": "group",
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "block_structure": None,
    }
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def quantize_groups(
    w: Any, groups: Any, num_groups: int, symmetric: bool, scale_dtype: Any
) -> tuple[Any, ...]:
    """w [out, in], groups [in] (each column's group, every group the same size) -> (q [out, in]
    unsigned 0..15, scale and zero [out, groups]) with w ~ (q - zero) * scale; the scale rounded to
    `scale_dtype` first, so the checkpoint's (q - zero) * scale is exactly what it holds."""
    import torch

    w = w.float()
    order = torch.argsort(groups, stable=True)  # columns of group 0, then 1, ...
    by_group = w[:, order].reshape(w.shape[0], num_groups, -1)  # [out, G, in/G]
    wmax, wmin = by_group.amax(dim=2), by_group.amin(dim=2)  # [out, G]
    if symmetric:  # GPTQ sym / llm-compressor: zero 8, scale from the largest magnitude
        scale = torch.maximum(wmax.abs(), wmin.abs()) / 7.5
    else:
        scale = (wmax - wmin) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype).float()
    zero = torch.full_like(scale, 8.0) if symmetric else (-wmin / scale).round().clamp(0, 15)
    q = (w / scale[:, groups]).round() + zero[:, groups]
    return q.clamp(0, 15).to(torch.int64), scale.to(scale_dtype), zero.to(torch.int64)


def _words(nibbles: list[Any]) -> Any:
    """Eight int64 tensors of values 0..15 -> one int32 word each: value i in bits 4i..4i+3."""
    import torch

    word = sum(v << (4 * i) for i, v in enumerate(nibbles))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the top bit is the sign


def _awq_tensors(q: Any, zero: Any, scale: Any) -> dict[str, Any]:
    """AWQ: qweight [in, out/8], qzeros [in/G, out/8], scales [in/G, out] float16."""
    qt, zt = q.t(), zero.t()  # [in, out], [G, out]
    qweight = _words([qt[:, AWQ_ORDER[i] :: 8] for i in range(8)])
    qzeros = _words([zt[:, AWQ_ORDER[i] :: 8] for i in range(8)])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous()}


def _gptq_tensors(q: Any, zero: Any, scale: Any, groups: Any) -> dict[str, Any]:
    """GPTQ v1: qweight [in/8, out] (word r, nibble j: input row 8r + j), qzeros [G, out/8]
    holding zero - 1, scales [G, out] float16, g_idx [in] int32."""
    import torch

    qt, zt = q.t(), zero.t() - 1
    qweight = _words([qt[j::8] for j in range(8)])
    qzeros = _words([zt[:, j::8] for j in range(8)])
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scale.t().contiguous(),
        "g_idx": groups.to(torch.int32),
    }


def _w4a16_tensors(q: Any, scale: Any) -> dict[str, Any]:
    """pack-quantized: weight_packed [out, in/8] (signed values + 8, column 8c + j in nibble j of
    word c), weight_scale [out, G], weight_shape [out, in] int64."""
    import torch

    packed = _words([q[:, j::8] for j in range(8)])
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(list(q.shape))}


def quantize_checkpoint(
    out: pathlib.Path, fmt: str, group_size: int, act_order: bool = False, seed: int = 0, device: str = "cpu"
) -> None:
    """Rewrite the demo checkpoint in `out` shard by shard (and its index): each dense projection
    `X.weight` becomes the format's `X.*` tensors (the arithmetic on `device`)."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def int4(name: str, tensor: Any) -> dict[str, Any]:
        parts = _quantized(tensor.to(device), fmt, group_size, act_order, generator)
        prefix = name.removesuffix("weight")
        return {prefix + k: v.cpu().contiguous() for k, v in parts.items()}

    rewrite_projections(out, lambda name: bool(_PROJECTION.search(name)), int4)


def _quantized(tensor: Any, fmt: str, group_size: int, act_order: bool, generator: Any) -> dict[str, Any]:
    """One projection's weight [out, in] as the format's tensors."""
    import torch

    cols = tensor.shape[1]
    groups = torch.arange(cols) // group_size
    if act_order:  # desc_act: columns quantized in a permuted order, so groups scatter
        groups = groups[torch.randperm(cols, generator=generator)]
    groups = groups.to(tensor.device)
    scale_dtype = tensor.dtype if fmt == "w4a16" else torch.float16
    q, scale, zero = quantize_groups(tensor, groups, cols // group_size, fmt != "awq", scale_dtype)
    if fmt == "awq":
        return _awq_tensors(q, zero, scale)
    if fmt == "gptq":
        return _gptq_tensors(q, zero, scale, groups)
    return _w4a16_tensors(q, scale)


def write_int4(
    out: pathlib.Path, fmt: str, config_json: dict[str, Any], device: str = "cpu"
) -> dict[str, Any]:
    """Quantize the checkpoint in `out` to `fmt` (sharded or not; the arithmetic on `device`);
    config_json's quantization_config to add."""
    hidden, inter = int(config_json["hidden_size"]), int(config_json["intermediate_size"])
    heads = int(config_json["num_attention_heads"])
    head_dim = int(config_json.get("head_dim") or hidden // heads)
    group_size = group_size_for([hidden, inter, heads * head_dim])
    quantize_checkpoint(out, fmt, group_size, device=device)
    return quantization_config(fmt, group_size)
