"""The paged KV cache: how many blocks it gets, and the per-layer K and V tensors.

On CPU the cache gets a fixed budget (1 GiB unless told). On CUDA it gets what the card has left
once the weights and a maximal step fit under --gpu-memory-utilization, vLLM's rule: the runner
profiles one step of max_num_batched_tokens tokens (maximal_step, under profile_gpu_memory) and
gpu_kv_cache_bytes turns the figures into the cache's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.core.sequence import Request, Sequence
from corral_engine.errors import ModelLoadError
from corral_engine.model_args import DEFAULT_KV_CACHE_MEMORY_BYTES
from corral_engine.outputs import RequestMetrics
from corral_engine.sampling_params import SamplingParams

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [blocks, block_size, KVH, D]


def num_kv_blocks(
    args: EngineArgs,
    bytes_per_block: int,
    max_model_len: int,
    measured_bytes: Callable[[], int] | None = None,
) -> int:
    """Blocks as given, else as many as the byte budget holds. Without either: on CUDA
    (`measured_bytes`, called only then) what the card has left; elsewhere a fixed budget, but no
    more than twice what max_num_seqs full-length sequences can use (the surplus keeps
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
    if measured_bytes is not None:
        return int(measured_bytes() // bytes_per_block)
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


GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class GpuMemoryProfile:
    total_bytes: int  # the card's memory
    peak_torch_bytes: int  # PyTorch's peak allocation in the profiled step, weights included
    non_torch_bytes: int  # what this process added outside PyTorch's allocator since it began (NCCL, ...)
    others_bytes: int = 0  # in use when this engine began: other processes, this one's CUDA context

    def describe(self) -> str:
        return (
            f"GPU memory {self.total_bytes / GIB:.1f} GiB: weights and a maximal step peak at "
            f"{self.peak_torch_bytes / GIB:.2f} GiB, {self.non_torch_bytes / GIB:.2f} GiB outside PyTorch, "
            f"{self.others_bytes / GIB:.2f} GiB in use before it started"
        )


def gpu_kv_cache_bytes(profile: GpuMemoryProfile, utilization: float) -> int:
    """KV-cache bytes: the share of the card this engine may use (vLLM's meaning: per engine, so
    two on one card at 0.45 each fit), less the profiled peak and what this process added outside
    PyTorch. Memory held by other processes does not shrink the share; it must leave room for it."""
    budget = int(profile.total_bytes * utilization)
    if budget > profile.total_bytes - profile.others_bytes:
        most = (profile.total_bytes - profile.others_bytes) / profile.total_bytes
        raise ModelLoadError(
            f"--gpu-memory-utilization {utilization} asks for {budget / GIB:.2f} GiB of the card's "
            f"{profile.total_bytes / GIB:.1f} GiB, but {profile.others_bytes / GIB:.2f} GiB were in use "
            f"when this engine started (other processes, its CUDA context): at most {most:.2f} fits; "
            "lower it (it is each engine's own share of the card)"
        )
    kv_bytes = budget - profile.peak_torch_bytes - profile.non_torch_bytes
    if kv_bytes <= 0:
        raise ModelLoadError(
            f"no GPU memory left for the KV cache: {profile.describe()}, and --gpu-memory-utilization "
            f"{utilization} allows {budget / GIB:.2f} GiB; raise it, lower "
            "--max-num-batched-tokens or --max-num-seqs, or use a larger card"
        )
    return kv_bytes


class CudaMemory(Protocol):
    """The slice of torch.cuda's memory API the profile reads (faked in tests)."""

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes on the card
    def max_memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TorchCudaMemory:
    device: torch.device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def used_outside_torch(memory: CudaMemory) -> int:
    """Bytes in use on the card that PyTorch's allocator in this process does not hold."""
    free, total = memory.mem_get_info()
    return max(0, total - free - memory.memory_reserved())


def profile_gpu_memory(
    memory: CudaMemory, run_step: Callable[[], object], others_bytes: int = 0
) -> GpuMemoryProfile:
    """Run one maximal step and read the card's figures; `others_bytes`: `used_outside_torch` when
    the engine began, before its weights (other processes, its CUDA context), not counted as its own."""
    memory.empty_cache()
    memory.reset_peak_memory_stats()
    run_step()
    memory.synchronize()
    peak = memory.max_memory_allocated()
    memory.empty_cache()
    total = memory.mem_get_info()[1]
    added = max(0, used_outside_torch(memory) - others_bytes)
    return GpuMemoryProfile(total, peak, added, others_bytes)


def maximal_step(args: EngineArgs, max_model_len: int) -> tuple[list[ScheduledSeq], int]:
    """The largest step the scheduler allows (max_num_batched_tokens tokens over up to
    max_num_seqs prefilling sequences) and the KV blocks it fills, numbered from 0: the step the
    memory profile runs. Its sequences' ids are negative, apart from any real one's."""
    bs = args.block_size
    num_seqs = max(1, min(args.max_num_seqs, args.max_num_batched_tokens))
    num_tokens = min(args.max_num_batched_tokens, num_seqs * max_model_len)
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    lengths = [n for n in lengths if n > 0]
    scheduled, next_block = [], 0
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks)
        params = SamplingParams(max_tokens=1)
        request = Request(f"memory-profile-{i}", [0] * n, params, i, RequestMetrics(0.0))
        seq = Sequence(-1 - i, request, 0, [0] * n, n, block_table=blocks)
        request.seqs.append(seq)
        scheduled.append(ScheduledSeq(seq, 0, n))
    return scheduled, next_block
