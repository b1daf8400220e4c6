"""What constrained decoding costs: engine step time with and without a grammar at batch 1 and 64,
where the grammar's time goes, and W2's throughput when a quarter of its requests use a JSON schema.

    .venv/bin/python bench/engine/structured_cost.py [--model DIR] [--out FILE] [--w2-prompts N]
    .venv/bin/python bench/engine/structured_cost.py --served [--no-offline-w2]   # + W2 served

The model is the engine benchmarks' reference (`corral demo-model ~/.cache/corral-bench/model-small
--preset small`: ~107M-parameter Llama, 32,000-token vocabulary, random weights, bf16). The grammar
is a JSON schema whose documents are longer than any output here (an array of at least 64 objects),
so a constrained sequence stays inside the grammar for all of its tokens and its output length is
the workload's (the same tokens are generated with and without it). Offline (LLMEngine), one
process: the two sides of each comparison alternate A B A B and the best of each is reported.
With --served, W2 is also replayed through `corral engine` by `corral bench` (streamed completions,
all at once, fresh prompts each run): plain, then with every fourth request carrying the schema as
vLLM's `structured_outputs` field, in A B B A order per pair of rounds so a steady drift favours
neither side.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from corral_engine.args import EngineArgs
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams
from corral_engine.structured.masks import MaskBuilder, TokenMasks, apply_token_masks
from corral_engine.structured.spec import GrammarSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runner  # the engine benchmarks' server runner and workloads, next to this file
import workloads
from systems import Settings
from systems import build as build_system

log = logging.getLogger("structured_cost")
LONG_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 16},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
}
LONG_JSON = GrammarSpec.json_schema(LONG_SCHEMA, "bench")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path.home() / ".cache/corral-bench/model-small")
    p.add_argument("--out", type=Path, default=Path("bench/results/structured_cost.json"))
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=2, help="A B rounds per comparison")
    p.add_argument("--w2-prompts", type=int, default=200, help="W2 requests (200 is the full workload)")
    p.add_argument("--w2-repeats", type=int, default=2, help="A B rounds of W2")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--micro-only", action="store_true", help="only the grammar's own work (no model runs)")
    p.add_argument(
        "--served", action="store_true", help="also W2 served through corral engine + corral bench"
    )
    p.add_argument("--served-rounds", type=int, default=2, help="A B B A pairs of served W2 runs")
    p.add_argument("--no-offline-w2", action="store_true", help="skip the offline W2 comparison")
    return p.parse_args()


def make_engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model=str(args.model),
            dtype="bfloat16",
            num_threads=args.threads,
            max_num_seqs=256,
            kv_cache_memory_bytes=2 << 30,
            enable_prefix_caching=False,
        )
    )


def step_cost(engine: LLMEngine, batch: int, grammar: GrammarSpec | None, steps: int) -> dict[str, float]:
    """Mean decode step time of `batch` sequences, and the grammar's share of it."""
    prompt = list(range(100, 132))
    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 4, seed=i, ignore_eos=True, grammar=grammar)
        engine.add_request(f"b{batch}-{grammar is not None}-{time.monotonic_ns()}-{i}", prompt, params)
    engine.step()  # the prefills
    engine.step()
    stats = engine.grammar_masks.stats
    fill0, wait0, fills0 = stats.fill_s, stats.wait_s, stats.num_fills
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.grammar_masks.stats
    num = max(1, stats.num_fills - fills0)
    return {
        "step_ms": 1e3 * statistics.mean(times),
        "fill_ms": 1e3 * (stats.fill_s - fill0) / num if grammar else 0.0,
        "stall_ms": 1e3 * (stats.wait_s - wait0) / num if grammar else 0.0,
    }


def apply_cost(batch: int, vocab: int, width: int) -> float:
    """ms to apply `batch` masks to [batch, vocab] float32 logits (the sampler's part)."""
    logits = torch.randn(batch, vocab)
    masks = TokenMasks(list(range(batch)), torch.full((batch, width), 0x55555555, dtype=torch.int32))
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        apply_token_masks(logits.clone(), masks)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def grammar_micro(engine: LLMEngine, batch: int, steps: int = 40) -> dict[str, float]:
    """The grammar's own work per step, without the model: `batch` matchers walk random allowed
    tokens; best-of timings (ms) of filling the masks, applying them, and advancing the matchers."""
    compiler = engine.grammars
    builder = MaskBuilder(compiler.mask_width)
    matchers = [compiler.matcher(LONG_JSON) for _ in range(batch)]
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    fill, apply, advance = float("inf"), float("inf"), float("inf")
    bitmask = torch.empty((batch, compiler.mask_width), dtype=torch.int32)
    logits = torch.randn(batch, vocab)
    for _ in range(steps):
        start = time.perf_counter()
        builder._fill([(m, i) for i, m in enumerate(matchers)], bitmask)
        fill = min(fill, time.perf_counter() - start)
        masked = logits.clone()
        start = time.perf_counter()
        apply_token_masks(masked, TokenMasks(list(range(batch)), bitmask))
        apply = min(apply, time.perf_counter() - start)
        allowed = torch.isfinite(masked)
        tokens = [rng.choice(allowed[i].nonzero().flatten().tolist()) for i in range(batch)]
        start = time.perf_counter()
        for m, t in zip(matchers, tokens, strict=True):
            m.consume_token(t)
        advance = min(advance, time.perf_counter() - start)
    return {"fill_ms": 1e3 * fill, "apply_ms": 1e3 * apply, "advance_ms": 1e3 * advance}


def w2(engine: LLMEngine, records: list[dict[str, Any]], share: float) -> dict[str, float]:
    """Output tok/s of W2 (all at once) with `share` of the requests constrained by LONG_JSON."""
    every = round(1 / share) if share else 0
    prompts, params = [], []
    for i, r in enumerate(records):
        grammar = LONG_JSON if every and i % every == 0 else None
        max_tokens = int(r["output_len"])
        params.append(SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True, grammar=grammar))
        prompts.append(list(r["prompt"]))
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def served_w2(args: argparse.Namespace) -> dict[str, Any]:
    """W2 through `corral engine`: output tok/s, TTFT and TPOT, plain against 25% constrained."""
    out_dir = args.out.parent / "structured_cost_served"
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(args.served_rounds):
        for j, share in enumerate((0.0, 0.25) if k % 2 == 0 else (0.25, 0.0)):
            records = workloads.build("W2", args.model, variant=2 * k + j + 1)[: args.w2_prompts]
            if share:
                for i in range(0, len(records), round(1 / share)):
                    records[i]["extra_body"] = {"structured_outputs": {"json": LONG_SCHEMA}}
            key = f"{'json25' if share else 'off'}#{k}"
            path = workloads.write(records, out_dir / f"w2-{key.replace('#', '-')}.jsonl")
            runs.append(runner.ServedRun(key, path, len(records), "inf"))
    settings = Settings(threads=args.threads or 2)
    result = runner.run_served(build_system("corral", settings), args.model, runs, out_dir, settings, 1800.0)
    by_side: dict[str, list[dict[str, Any]]] = {"off": [], "json25": []}
    for key, summary in result["runs"].items():
        if "error" not in summary:
            by_side[key.split("#")[0]].append(summary)
    fields = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "failed")
    return {
        "runs": {k: {f: v.get(f) for f in fields} for k, v in result["runs"].items() if "error" not in v},
        "errors": {k: v for k, v in result["runs"].items() if "error" in v},
        "median_tok_s": {
            k: statistics.median(s["output_throughput"] for s in v) for k, v in by_side.items() if v
        },
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    engine = make_engine(args)
    results: dict[str, Any] = {"model": str(args.model), "steps": {}, "apply_ms": {}}
    width = engine.grammars.mask_width if engine.grammars.ll_tokenizer else 0
    results["micro"] = {batch: grammar_micro(engine, batch) for batch in (1, 64)}
    log.info("grammar work per step, best of 40: %s", results["micro"])
    if args.micro_only:
        log.info("results:\n%s", json.dumps(results, indent=2))
        return 0
    for batch in (1, 64):
        runs: dict[str, list[dict[str, float]]] = {"off": [], "json": []}
        for _ in range(args.repeats):
            runs["off"].append(step_cost(engine, batch, None, args.steps))
            runs["json"].append(step_cost(engine, batch, LONG_JSON, args.steps))
        best = {k: min(v, key=lambda r: r["step_ms"]) for k, v in runs.items()}
        results["steps"][batch] = best
        results["apply_ms"][batch] = apply_cost(batch, engine.model_config.vocab_size, width)
        log.info("batch %d: %s, apply %.2f ms", batch, best, results["apply_ms"][batch])
    records = workloads.build("W2", args.model)[: args.w2_prompts]
    results["w2_prompts"] = len(records)
    if not args.no_offline_w2:
        w2_runs: dict[str, list[dict[str, float]]] = {"off": [], "json25": []}
        for _ in range(args.w2_repeats):
            w2_runs["off"].append(w2(engine, records, 0.0))
            w2_runs["json25"].append(w2(engine, records, 0.25))
            log.info("W2: %s", {k: v[-1] for k, v in w2_runs.items()})
        results["w2"] = {k: max(v, key=lambda r: r["tok_s"]) for k, v in w2_runs.items()}
    if args.served:
        del engine  # the server gets the machine to itself
        results["w2_served"] = served_w2(args)
        log.info("W2 served: %s", results["w2_served"]["median_tok_s"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    log.info("wrote %s", args.out)
    log.info("results:\n%s", json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
