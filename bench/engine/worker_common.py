"""Shared by the offline workers, which run inside each system's own venv: standard library only.

A worker reads workloads as token-id JSONL, times one system's Python API on them and writes one JSON
result. Throughput counts the output tokens each request asked for (static batching's padded extra
tokens are not useful work); S1's time per output token is (t(256 tokens) - t(1 token)) / 255, the
same arithmetic for every system, so prefill does not count.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("worker")

Request = tuple[list[int], int]  # (prompt token ids, output tokens)
# generate(requests) -> output tokens actually produced
GenerateFn = Callable[[list[Request]], int]
NUM_S1_REPEATS = 3


def parse_args(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--workload", action="append", default=[], help="NAME=FILE.jsonl (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (transformers' worker: always)")
    if extra is not None:
        extra(p)
    return p.parse_args()


def load_workloads(specs: list[str]) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {}
    for spec in specs:
        name, path = spec.split("=", 1)
        lines = Path(path).read_text().splitlines()
        out[name] = [(list(r["prompt"]), int(r["output_len"])) for r in map(json.loads, lines) if r]
    return out


def warmup_requests(vocab_low: int = 100) -> list[Request]:
    """A few short requests so lazy initialisation and first-call costs are paid before timing."""
    return [([vocab_low + i + j for j in range(32)], 8) for i in range(4)]


def time_throughput(generate: GenerateFn, requests: list[Request]) -> dict[str, Any]:
    t0 = time.perf_counter()
    produced = generate(requests)
    elapsed = time.perf_counter() - t0
    asked = sum(n for _, n in requests)
    num_in = sum(len(p) for p, _ in requests)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "input_tokens": num_in,
        "output_tokens": asked,
        "generated_tokens": produced,
        "output_throughput": asked / elapsed,
        "input_throughput": num_in / elapsed,
        "total_throughput": (asked + num_in) / elapsed,
    }


def time_single(generate: GenerateFn, request: Request) -> dict[str, Any]:
    """S1: time per output token excluding prefill, median of a few repeats."""
    prompt, num_out = request
    tpots, e2es, prefills = [], [], []
    for i in range(NUM_S1_REPEATS):
        # a different first token per call: no call hits a prefix cache another one warmed
        t0 = time.perf_counter()
        generate([([_vary(prompt[0], 1 + 2 * i), *prompt[1:]], 1)])
        t1 = time.perf_counter()
        produced = generate([([_vary(prompt[0], 2 + 2 * i), *prompt[1:]], num_out)])
        t2 = time.perf_counter()
        prefills.append(t1 - t0)
        e2es.append(t2 - t1)
        tpots.append(((t2 - t1) - (t1 - t0)) / max(1, produced - 1))
    return {
        "output_tokens": num_out,
        "tpot_ms": 1000 * statistics.median(tpots),
        "tpot_ms_all": [1000 * t for t in tpots],
        "e2e_ms": 1000 * statistics.median(e2es),
        "prefill_ms": 1000 * statistics.median(prefills),
        "output_throughput": num_out / statistics.median(e2es),
    }


def run_all(
    system: str, generate: GenerateFn, workloads: dict[str, list[Request]], info: dict[str, Any], out: str
) -> None:
    """Warm up, then time each workload; the JSON is rewritten after each so a timeout keeps the rest."""
    result: dict[str, Any] = {"system": system, "python": platform.python_version(), **info, "workloads": {}}
    t0 = time.perf_counter()
    generate(warmup_requests())
    result["warmup_s"] = time.perf_counter() - t0
    for name, requests in workloads.items():
        log.info("%s: %s (%d requests)", system, name, len(requests))
        if name.startswith("S"):
            figures = time_single(generate, requests[0])
        else:
            figures = time_throughput(generate, requests)
        result["workloads"][name] = figures
        log.info(
            "%s: %s %s", system, name, json.dumps({k: v for k, v in figures.items() if k != "tpot_ms_all"})
        )
        Path(out).write_text(json.dumps(result, indent=2))
    Path(out).write_text(json.dumps(result, indent=2))


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def _vary(token_id: int, k: int) -> int:
    """Another ordinary token id (100..30099: inside any 32k vocabulary, clear of special ids)."""
    return 100 + (token_id + k) % 30000
