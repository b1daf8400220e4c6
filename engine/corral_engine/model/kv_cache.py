"""The paged KV cache: how many blocks it gets, and the per-layer K and V tensors."""

from __future__ import annotations

import torch

from corral_engine.args import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineArgs
from corral_engine.errors import ModelLoadError

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [blocks, block_size, KVH, D]


def num_kv_blocks(args: EngineArgs, bytes_per_block: int, max_model_len: int) -> int:
    """Blocks as given, else as many as the byte budget holds. Without either: a fixed budget, but
    no more than twice what max_num_seqs full-length sequences can use (the surplus keeps
    prefix-cache entries alive), so small models stay small."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if args.kv_cache_memory_bytes is not None:
        num = args.kv_cache_memory_bytes // bytes_per_block
        if num < 1:
            raise ModelLoadError(
                f"kv cache memory {args.kv_cache_memory_bytes} bytes holds no block of "
                f"{bytes_per_block} bytes; raise it"
            )
        return int(num)
    useful = 2 * args.max_num_seqs * -(-max_model_len // args.block_size)
    return int(max(1, min(DEFAULT_KV_CACHE_MEMORY_BYTES // bytes_per_block, useful)))


def allocate_kv_caches(
    num_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
) -> KvCaches:
    # Zeroed, not empty: batched decode reads (masked) slots nobody wrote yet, and a NaN there
    # would survive masking (0 * NaN); stale finite values from freed blocks are harmless.
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
