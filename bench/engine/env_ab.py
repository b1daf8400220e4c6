"""Two process environments side by side: settings read once at start-up (allocator, huge pages,
OpenMP), which one process cannot switch between.

    .venv/bin/python bench/engine/env_ab.py --a THP_MEM_ALLOC_ENABLE=0 --b THP_MEM_ALLOC_ENABLE=1
    .venv/bin/python bench/engine/env_ab.py --a LD_PRELOAD= --b LD_PRELOAD=/path/to/libtcmalloc_minimal.so.4

Each round starts one fresh process per side (the order flips every round, so a drifting machine
favours neither), builds an offline engine on the small demo checkpoint, warms it up with a few
requests and times one greedy batch (`--batch` x `--prompt-len` in, `--output-len` out, prefill
included). Both sides start from this process's environment plus Corral's engine defaults
(`corral_cli.malloc.engine_env`: tcmalloc where installed, huge pages); `--a` / `--b` override
them (`NAME=` with nothing after it unsets NAME). Prints output tok/s per round and the B/A
ratios; writes env_ab.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from corral_cli import malloc

log = logging.getLogger("env_ab")
MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", nargs="*", default=[], metavar="NAME=VALUE", help="side A's settings")
    p.add_argument("--b", nargs="*", default=[], metavar="NAME=VALUE", help="side B's settings")
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=256, help="as compare.py runs the engine")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/env-ab"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def side_env(settings: list[str]) -> dict[str, str]:
    env = malloc.engine_env(os.environ)
    for item in settings:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"settings are NAME=VALUE, got {item!r}")
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    return env


def worker(args: argparse.Namespace) -> None:
    """One timed batch in this process; prints {"tok_s": ...} as its last line."""
    from corral_engine.args import EngineArgs
    from corral_engine.llm_engine import LLMEngine
    from corral_engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineArgs(
            model=str(args.model),
            dtype=args.dtype,
            num_threads=args.threads,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=2048,
        )
    )
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]

    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:  # random token ids, as the comparison's workloads
        return [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(n)]

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts(4), params)  # warm-up
    start = time.perf_counter()
    engine.generate(prompts(args.batch), params)
    tok_s = args.batch * args.output_len / (time.perf_counter() - start)
    sys.stdout.write(json.dumps({"tok_s": tok_s}) + "\n")


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    envs = {"A": side_env(args.a), "B": side_env(args.b)}
    passthrough = [
        f"--model={args.model}", f"--dtype={args.dtype}", f"--batch={args.batch}",
        f"--prompt-len={args.prompt_len}", f"--output-len={args.output_len}", f"--threads={args.threads}",
        f"--max-num-seqs={args.max_num_seqs}",
    ]  # fmt: skip
    tok_s: dict[str, list[float]] = {"A": [], "B": []}
    for round_index in range(args.rounds):
        for side in ("A", "B") if round_index % 2 == 0 else ("B", "A"):
            done = subprocess.run(
                [sys.executable, __file__, "--worker", *passthrough],
                env=envs[side], capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                log.error("side %s failed (exit %d): %s", side, done.returncode, done.stderr.strip()[-2000:])
                return 1
            tok_s[side].append(json.loads(done.stdout.strip().splitlines()[-1])["tok_s"])
        log.info(
            "round %d: A %.1f  B %.1f tok/s  B/A %.3f",
            round_index + 1, tok_s["A"][-1], tok_s["B"][-1], tok_s["B"][-1] / tok_s["A"][-1],
        )  # fmt: skip
    ratios = [b / a for a, b in zip(tok_s["A"], tok_s["B"], strict=True)]
    result = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "worker"},
        "tok_s": tok_s,
        "ratios_b_over_a": ratios,
        "median_ratio": statistics.median(ratios),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "env_ab.json").write_text(json.dumps(result, indent=2))
    log.info(
        "A %s | B %s: B/A %s (median %.3f); wrote %s",
        " ".join(args.a) or "(defaults)", " ".join(args.b) or "(defaults)",
        " ".join(f"{r:.3f}" for r in ratios), result["median_ratio"], args.out_dir / "env_ab.json",
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
