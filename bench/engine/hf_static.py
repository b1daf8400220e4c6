"""transformers' static batching, the baseline continuous batching beats: requests in order, B at a
time, left-padded; a batch decodes until its longest request has its tokens.

Needs only torch and transformers: the CPU harness's worker (offline_hf.py, in its own venv) and the
GPU acceptance script (bench/gpu) both use it. Throughput counts the tokens each request asked for,
not the padded extra tokens a batch generates while its longest member finishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("worker")

Request = tuple[list[int], int]  # (prompt token ids, output tokens)


@dataclass(frozen=True, slots=True)
class BatchedRun:
    """What `generate_batched` got through: all the requests, or those before its deadline."""

    generated_tokens: int  # including the padded extra ones
    asked_tokens: int  # output tokens the requests run asked for
    input_tokens: int  # prompt tokens of the requests run
    num_requests_run: int
    elapsed_s: float


def run_batch(model: Any, batch: list[Request], pad_id: int) -> int:
    """One left-padded `generate` call (min_new_tokens = max_new_tokens, so EOS never ends it
    early); returns the tokens it generated."""
    width = max(len(p) for p, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, width]
    for row, (prompt, _) in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    new = max(n for _, n in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return int(out.shape[0] * (out.shape[1] - width))


def generate_batched(
    model: Any, requests: list[Request], batch_size: int, pad_id: int, deadline: float | None = None
) -> BatchedRun:
    """All requests, `batch_size` at a time, or as many batches as start before `deadline`
    (time.perf_counter()). Logs its pace after each batch, so a run cut short still shows it."""
    produced, asked, num_in, done, start = 0, 0, 0, 0, time.perf_counter()
    num_batches = -(-len(requests) // batch_size)
    for i in range(0, len(requests), batch_size):
        if deadline is not None and done and time.perf_counter() > deadline:
            log.info("transformers: deadline reached after %d of %d batches", i // batch_size, num_batches)
            break
        batch = requests[i : i + batch_size]
        produced += run_batch(model, batch, pad_id)
        asked += sum(n for _, n in batch)
        num_in += sum(len(p) for p, _ in batch)
        done += len(batch)
        if len(requests) > batch_size:
            elapsed = time.perf_counter() - start
            log.info(
                "transformers: batch %d of %d at %d: %d output tokens in %.0f s (%.1f tok/s)",
                i // batch_size + 1,
                num_batches,
                batch_size,
                asked,
                elapsed,
                asked / elapsed,
            )
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return BatchedRun(produced, asked, num_in, done, time.perf_counter() - start)


def best_batch(
    name: str, requests: list[Request], batch_sizes: list[int], run: Callable[[int], BatchedRun]
) -> Iterator[dict[str, Any]]:
    """The best figures so far, after each batch size; `run(batch_size)` runs the requests.

    A run cut short by a deadline reports its pace (asked tokens of the requests it ran / its time)
    and says `complete: false`."""
    per_size: dict[str, dict[str, Any]] = {}
    for bs in batch_sizes:
        log.info("transformers: %s at batch %d", name, bs)
        result = run(bs)
        per_size[str(bs)] = {
            "elapsed_s": result.elapsed_s,
            "output_throughput": result.asked_tokens / result.elapsed_s,
            "total_throughput": (result.asked_tokens + result.input_tokens) / result.elapsed_s,
            "generated_tokens": result.generated_tokens,
            "num_requests_run": result.num_requests_run,
            "complete": result.num_requests_run == len(requests),
        }
        log.info(
            "transformers: %s batch %d: %.1f output tok/s", name, bs, per_size[str(bs)]["output_throughput"]
        )
        best = max(per_size, key=lambda k: per_size[k]["output_throughput"])
        yield {
            "num_requests": len(requests),
            "input_tokens": sum(len(p) for p, _ in requests),
            "output_tokens": sum(n for _, n in requests),
            "best_batch_size": int(best),
            **{k: v for k, v in per_size[best].items() if k != "num_requests_run"},
            "per_batch_size": dict(per_size),
        }
