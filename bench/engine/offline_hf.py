"""Offline worker: transformers `generate` with static batches (the baseline continuous batching beats).

How a static batch runs and what counts: hf_static.py. Every workload is run at each batch size;
the best is reported.
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any

import hf_static
import torch
import transformers
from transformers import AutoModelForCausalLM
from worker_common import Request, load_workloads, parse_args, setup_logging, time_single, warmup_requests

log = logging.getLogger("worker")


def main() -> int:
    setup_logging()
    args = parse_args(_extra_args)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    w2_batch_sizes = [int(b) for b in (args.w2_batch_sizes or args.batch_sizes).split(",")]

    def generate_batched(requests: list[Request], batch_size: int) -> int:
        return hf_static.generate_batched(model, requests, batch_size, pad_id).generated_tokens

    result: dict[str, Any] = {
        "system": "transformers",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "settings": {
            "batch_sizes": batch_sizes,
            "w2_batch_sizes": w2_batch_sizes,
            "padding": "left",
            "dtype": args.dtype,
        },
        "workloads": {},
    }
    generate_batched(warmup_requests(), 4)
    # W2 last: each of its batch sizes takes minutes; results are written after every batch size,
    # so a timeout keeps what finished.
    for name, requests in sorted(load_workloads(args.workload).items(), key=lambda kv: kv[0] == "W2"):
        if name.startswith("S"):
            result["workloads"][name] = time_single(lambda r: generate_batched(r, 1), requests[0])
            _write(args.out, result)
            continue
        sizes = w2_batch_sizes if name == "W2" else batch_sizes
        run = functools.partial(hf_static.generate_batched, model, requests, pad_id=pad_id)
        for figures in hf_static.best_batch(name, requests, sizes, run):
            result["workloads"][name] = figures
            _write(args.out, result)
        log.info("transformers: %s %s", name, {k: v for k, v in figures.items() if k != "per_batch_size"})
    _write(args.out, result)
    return 0


def _extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="8,16,32")
    p.add_argument("--w2-batch-sizes", help="batch sizes for W2 (default: --batch-sizes)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="float32 is transformers' faster choice on CPUs without native bf16",
    )


def _write(path: str, result: dict[str, Any]) -> None:
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
