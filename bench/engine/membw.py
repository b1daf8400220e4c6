"""Memory bandwidth (a torch copy benchmark) and the bytes one decode step at batch 1 must read.

Model bandwidth utilization (MBU) at batch 1 = (weight bytes + KV bytes read per token) / time per
output token / measured bandwidth. Run as a worker: `python membw.py --threads 2 --out FILE.json`.
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path
from typing import Any

COPY_BYTES = 512 << 20  # well past the last-level cache
NUM_COPY_REPEATS = 10
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4}


def measure_copy_bandwidth(threads: int) -> dict[str, float]:
    """Best-of-N `dst.copy_(src)`: bytes read + bytes written per second."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)  # [N]
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    times = []
    for _ in range(NUM_COPY_REPEATS):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    best, median = min(times), sorted(times)[len(times) // 2]
    return {
        "threads": threads,
        "buffer_bytes": COPY_BYTES,
        "copy_gb_s_best": 2 * COPY_BYTES / best / 1e9,
        "copy_gb_s_median": 2 * COPY_BYTES / median / 1e9,
    }


def safetensors_bytes(model_dir: Path) -> dict[str, int]:
    """Parameter bytes by tensor, from the safetensors headers (no torch needed)."""
    sizes: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            sizes[name] = end - start
    return sizes


def decode_bytes_per_token(model_dir: Path, context_len: float) -> dict[str, float]:
    """Bytes one batch-1 decode step reads: every weight once (the tied embedding as the LM head;
    the input lookup reads one row) plus K and V of `context_len` tokens in every layer."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = sum(safetensors_bytes(model_dir).values())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = 2  # bf16 weights and KV
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    return {
        "weight_bytes": float(weights),
        "kv_bytes_per_context_token": float(kv_per_token),
        "mean_context_len": context_len,
        "bytes_per_token": weights + kv_per_token * context_len,
    }


def mbu(bytes_per_token: float, tpot_ms: float, bandwidth_gb_s: float) -> dict[str, float]:
    achieved = bytes_per_token / (tpot_ms / 1000) / 1e9
    return {"achieved_gb_s": achieved, "mbu": achieved / bandwidth_gb_s}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result: dict[str, Any] = measure_copy_bandwidth(args.threads)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
