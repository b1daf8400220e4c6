"""The KV cache's storage dtype (--kv-cache-dtype): the model's, or fp8, into which new K/V rows are
cast with a per-tensor scale of 1.0 (vLLM's default without calibrated k/v scales), saturating at
the format's largest finite value (e4m3: 448, e5m2: 57344); readers convert rows back as they read."""

from __future__ import annotations

import torch

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,  # vLLM's meaning on CUDA
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for option value `name`: "auto" (or anything not fp8) is the model's."""
    return FP8_DTYPES.get(name, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` cast to the cache's dtype. Into fp8 it is clamped to the finite range first: PyTorch's
    e5m2 cast turns an out-of-range value into inf, and no cast promises to saturate."""
    if x.dtype == cache_dtype:
        return x
    top = torch.finfo(cache_dtype).max
    return x.clamp(-top, top).to(cache_dtype)


def write_fp8(
    k: torch.Tensor,  # [T, KVH, D] in the model's dtype
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] fp8
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64: block * block_size + offset
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new K/V rows cast into their fp8 cache slots; returns them as the cache now holds
    them, in k's dtype ([T, KVH, D] each), so this step attends what later steps will read."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k8, v8 = to_cache(k, k_cache.dtype), to_cache(v, v_cache.dtype)
    # As bytes: PyTorch's CPU index_copy_ takes no fp8, and moving bytes is all a copy does.
    k_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k8.view(torch.uint8))
    v_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v8.view(torch.uint8))
    return k8.to(k.dtype), v8.to(v.dtype)
