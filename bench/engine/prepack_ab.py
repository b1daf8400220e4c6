"""Prepacked Linear weights (CORRAL_PREPACK) on and off, side by side in one process.

    .venv/bin/python bench/engine/prepack_ab.py [--dtype float32] [--batch 64] [--rounds 4]

Builds two engines on the small demo checkpoint, one with `CORRAL_PREPACK=0` and one with
`--on` (default `1`: float32, and bf16 where oneDNN can pack it, e.g. on AMX; on CPUs without
native bf16, `--dtype bfloat16` compares prepacked float32 copies for upcast batches with converting
the weights per call), and generates the
same greedy batch on each in turn (the order flips every round, so a drifting machine favours
neither). Prints output tok/s per round, the per-round ratios and whether the tokens match;
writes prepack.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Literal

from corral_engine.args import EngineArgs
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.runner import ModelRunner
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

log = logging.getLogger("prepack_ab")
MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--on",
        default="1",
        choices=("auto", "1"),
        help="CORRAL_PREPACK value for the packed engine (auto or 1)",
    )
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/prepack"))
    return p.parse_args()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args()
    engines: dict[str, LLMEngine] = {}
    arms: list[tuple[str, Literal["auto", "1", "0"]]] = [
        ("plain", "0"),
        ("packed", "auto" if args.on == "auto" else "1"),
    ]
    for name, switch in arms:
        engines[name] = LLMEngine(
            EngineArgs(
                model=str(args.model),
                dtype=args.dtype,
                num_threads=args.threads,
                max_num_seqs=max(args.batch, 1),
                max_num_batched_tokens=2048,
            ),
            EngineSettings(prepack=switch),
        )
    runner = engines["packed"].runner
    assert isinstance(runner, ModelRunner)  # one rank of a decoder
    head = runner.model.lm_head
    assert head is not None  # a generating model's
    is_packed = head.packed is not None or head.upcast_packed is not None
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = [[1 + (i * 7 + j) % (vocab - 1) for j in range(args.prompt_len)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def run(engine: LLMEngine) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        tok_s = args.batch * args.output_len / (time.perf_counter() - start)
        return tok_s, [list(o.outputs[0].token_ids) for o in outputs]

    for engine in engines.values():
        run(engine)  # warm-up
    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(args.rounds):
        order = ["plain", "packed"] if round_index % 2 == 0 else ["packed", "plain"]
        for name in order:
            value, tokens[name] = run(engines[name])
            tok_s[name].append(value)
    ratios = [p / q for p, q in zip(tok_s["packed"], tok_s["plain"], strict=True)]
    pairs = list(zip(tokens["plain"], tokens["packed"], strict=True))
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "packed_engine_is_packed": is_packed,
        "tok_s": tok_s,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "greedy_identical": tokens["plain"] == tokens["packed"],
        # Where they differ (bf16 rounds each layer's output, so a different float32 summation
        # order can flip a near-tie): how many sequences match, and their mean common prefix.
        "num_identical_sequences": sum(a == b for a, b in pairs),
        "mean_common_prefix": statistics.mean(_common_prefix(a, b) for a, b in pairs),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "prepack.json").write_text(json.dumps(result, indent=2))
    log.info(
        f"{args.dtype}, batch {args.batch}, packed engine packed: {is_packed}\n"
        f"plain  tok/s: {' '.join(f'{x:.0f}' for x in tok_s['plain'])}\n"
        f"packed tok/s: {' '.join(f'{x:.0f}' for x in tok_s['packed'])}\n"
        f"ratios: {' '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f}); "
        f"greedy identical: {result['greedy_identical']} ({result['num_identical_sequences']} of "
        f"{args.batch} sequences, mean common prefix {result['mean_common_prefix']:.1f} of {args.output_len})"
    )
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    raise SystemExit(main())
