"""Offline worker: transformers `generate` with static batches (the baseline continuous batching beats).

Requests are taken in order in batches of B, left-padded; a batch decodes until its longest request
has its tokens (min_new_tokens = max_new_tokens, so EOS never ends it early). Throughput counts only the
tokens each request asked for. Every workload is run at each batch size; the best is reported.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from typing import Any

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

    def run_batch(batch: list[Request]) -> int:
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, width]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, width]
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(n for _, n in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return int(out.shape[0] * (out.shape[1] - width))

    def generate_batched(requests: list[Request], batch_size: int) -> int:
        """All requests, `batch_size` at a time; logs the tokens asked for so far after each batch
        (a run cut short by the harness's timeout still shows how fast it was going)."""
        produced, asked, start = 0, 0, time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            produced += run_batch(batch)
            asked += sum(n for _, n in batch)
            if len(requests) > batch_size:
                log.info("transformers: batch %d of %d at %d: %d output tokens in %.0f s (%.1f tok/s)",
                         i // batch_size + 1, -(-len(requests) // batch_size), batch_size, asked,
                         time.perf_counter() - start, asked / (time.perf_counter() - start))  # fmt: skip
        return produced

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
        for figures in _best_batch(name, requests, sizes, generate_batched):
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


def _best_batch(
    name: str, requests: list[Request], batch_sizes: list[int], generate_batched: Any
) -> Iterator[dict[str, Any]]:
    """The best figures so far, after each batch size."""
    asked = sum(n for _, n in requests)
    num_in = sum(len(p) for p, _ in requests)
    per_size = {}
    for bs in batch_sizes:
        log.info("transformers: %s at batch %d", name, bs)
        t0 = time.perf_counter()
        produced = generate_batched(requests, bs)
        elapsed = time.perf_counter() - t0
        per_size[str(bs)] = {
            "elapsed_s": elapsed,
            "output_throughput": asked / elapsed,
            "generated_tokens": produced,
        }
        log.info("transformers: %s batch %d: %.1f output tok/s", name, bs, asked / elapsed)
        best = max(per_size, key=lambda k: per_size[k]["output_throughput"])
        yield {
            "num_requests": len(requests),
            "input_tokens": num_in,
            "output_tokens": asked,
            "best_batch_size": int(best),
            "elapsed_s": per_size[best]["elapsed_s"],
            "generated_tokens": per_size[best]["generated_tokens"],
            "output_throughput": per_size[best]["output_throughput"],
            "total_throughput": (asked + num_in) / per_size[best]["elapsed_s"],
            "per_batch_size": dict(per_size),
        }


def _write(path: str, result: dict[str, Any]) -> None:
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
