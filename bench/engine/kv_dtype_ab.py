"""The fp8 KV cache's figures on this machine: KV blocks from one memory budget, and the decode step at
batch 64, with --kv-cache-dtype auto and fp8, one process, the arms' steps interleaved round by round.

    .venv/bin/python bench/engine/kv_dtype_ab.py [--dtype float32] [--batch 64] [--rounds 5]

Arms: auto (the model's dtype) and fp8 (e4m3), each with the native paged decode kernel where it
builds (it reads fp8 bytes straight into its float32 tiles) and with PyTorch SDPA (-sdpa: gathers,
fp8 converted by PyTorch after them). Prints a Markdown table of median step times.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from corral_engine.args import EngineArgs, parse_bytes
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.runner import ModelRunner
from corral_engine.sampling_params import SamplingParams

log = logging.getLogger("kv_dtype_ab")
MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"
ARMS = {
    "auto": ("auto", "auto"),
    "fp8": ("fp8", "auto"),
    "auto-sdpa": ("auto", "sdpa"),
    "fp8-sdpa": ("fp8", "sdpa"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--dtype", default="float32", help="the model's dtype (float32: AVX2 CPUs' auto)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per arm and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv-cache-memory", default="512Mi", help="each arm's KV-cache budget")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arms", default=",".join(ARMS))
    return p.parse_args()


def start(args: argparse.Namespace, arm: str, prompts: list[list[int]]) -> LLMEngine:
    """An engine for `arm` with the batch added and stepped until every sequence decodes."""
    kv_dtype, backend = ARMS[arm]
    engine = LLMEngine(
        EngineArgs(
            model=str(args.model),
            dtype=args.dtype,
            kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]
            attention_backend=backend,  # type: ignore[arg-type]
            kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
            num_threads=args.threads,
            max_num_seqs=args.batch,
            max_num_batched_tokens=2048,
        )
    )
    params = SamplingParams(max_tokens=args.rounds * args.steps + 16, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{arm}-{i}", prompt, params)
    while any(s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.live_sequences()):
        engine.step()
    for _ in range(3):  # first-call costs paid before timing
        engine.step()
    return engine


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = [[1 + (i * 7 + j) % (vocab - 1) for j in range(args.prompt_len)] for i in range(args.batch)]
    arms = args.arms.split(",")
    engines = {arm: start(args, arm, prompts) for arm in arms}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm in arms if round_ % 2 == 0 else arms[::-1]:  # alternate the order: drift cancels
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engines[arm].step()
            times[arm].append(1000 * (time.perf_counter() - t0) / args.steps)
    base = statistics.median(times[arms[0]])
    lines = [
        f"batch {args.batch}, {args.dtype} model, {args.kv_cache_memory} KV budget, {args.rounds} rounds "
        f"of {args.steps} decode steps",
        "",
        "| arm | KV blocks | attention | median step ms | range | vs " + arms[0] + " |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        runner = engines[arm].runner
        backend = runner.attention_backend if isinstance(runner, ModelRunner) else "?"
        median = statistics.median(times[arm])
        lines.append(
            f"| {arm} | {runner.num_kv_blocks} | {backend} | {median:.1f} | "
            f"{min(times[arm]):.1f}-{max(times[arm]):.1f} | {median / base:.2f}x |"
        )
    log.info("results\n%s", "\n".join(lines))
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
