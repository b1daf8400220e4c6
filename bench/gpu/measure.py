"""Measuring tools of the GPU run: device timing, memory bandwidth, the bytes a batch-1 decode step
reads, and the time a profiled stretch spent in kernels.

Bandwidth: `x.sum()` over a buffer far larger than the L2 cache counts the buffer's bytes once
(read only); `dst.copy_(src)` counts them twice (read + write). Model-bandwidth utilisation divides
by the read figure, since a decode step mostly reads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from corral_engine.demo_model import count_parameters

NUM_WARMUP = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds per call, each call timed alone after a few warm-ups (CUDA events on CUDA)."""
    for _ in range(NUM_WARMUP):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def bandwidth(device: torch.device, num_bytes: int, repeats: int) -> dict[str, Any]:
    """Read bandwidth (sum) and copy bandwidth (read + write) of `num_bytes` buffers, GB/s."""
    read = _time_read(device, num_bytes, repeats)
    copy = _time_copy(device, num_bytes // 2, repeats)
    return {
        "buffer_bytes": num_bytes,
        "repeats": repeats,
        "read_gb_s_median": num_bytes / statistics.median(read) / 1e9,
        "read_gb_s_best": num_bytes / min(read) / 1e9,
        "copy_gb_s_median": num_bytes / statistics.median(copy) / 1e9,
        "copy_gb_s_best": num_bytes / min(copy) / 1e9,
        "method": "read: x.sum() over the buffer (bytes counted once); copy: dst.copy_(src) of half "
        "the buffer each (bytes read + bytes written)",
    }


def _time_read(device: torch.device, num_bytes: int, repeats: int) -> list[float]:
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # [N]
    return time_calls(lambda: x.sum(), device, repeats)


def _time_copy(device: torch.device, num_bytes: int, repeats: int) -> list[float]:
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # [N]
    dst = torch.empty_like(src)
    return time_calls(lambda: dst.copy_(src), device, repeats)


def decode_bytes_per_token(config: dict[str, Any], itemsize: int, context_len: float) -> dict[str, float]:
    """Bytes one batch-1 decode step reads: every weight once, except the input embedding when it
    is untied (one row of it is looked up; a tied one is read whole as the LM head), plus K and V of
    `context_len` tokens in every layer."""
    hidden = int(config["hidden_size"])
    params = count_parameters(config)
    if not config.get("tie_word_embeddings"):
        params -= int(config["vocab_size"]) * hidden - hidden
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    kv_per_token = 2 * int(config["num_hidden_layers"]) * int(config["num_key_value_heads"]) * head_dim
    weight_bytes = params * itemsize
    kv_bytes = kv_per_token * itemsize * context_len
    return {
        "weight_bytes": float(weight_bytes),
        "kv_bytes_per_context_token": float(kv_per_token * itemsize),
        "mean_context_len": context_len,
        "bytes_per_token": weight_bytes + kv_bytes,
    }


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_intervals(events: Any, device: torch.device) -> tuple[list[tuple[float, float]], str]:
    """(start, end) in µs of what ran on the device in a torch.profiler trace, and what was counted.

    CUDA: every device-side event (kernels, memcpy, memset), user annotations excluded. CPU: every
    aten operator (nested ones fall inside their parents, so the union counts each moment once);
    there the "kernels" are the operators' own work, the rest is Python and the engine's bookkeeping.
    """
    from torch.autograd import DeviceType

    if device.type == "cuda":
        picked = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        what = "CUDA device events (kernels, memcpy, memset)"
    else:
        picked = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        what = "CPU aten operators (no CUDA here)"
    return [(e.time_range.start, e.time_range.end) for e in picked], what
