"""What --quantization int8 and an int4 (AWQ) checkpoint do to CPU speed and memory, against the
model dtype, side by side.

    .venv/bin/python bench/engine/quant_ab.py [--rounds 3] [--num-requests 64] [--dtype bfloat16]
    .venv/bin/python bench/engine/quant_ab.py --quick        # W2's quick sizes, one round

Offline engines on the small demo checkpoint (written there once when missing), the same settings
but for the weights: "plain" (--dtype weights), "int8" (--quantization int8: the attention and MLP
projections int8 with a scale per row, the rest in --dtype) and "awq" (the same random weights
written as an AWQ int4 checkpoint beside it, `<model>-awq`: int4 projections through PyTorch's
int4 kernel for bfloat16, dequantized at load for float32); --arms picks. Each round runs, on each engine in
turn (the order flips every round, so a drifting machine favours neither): the first
--num-requests of W2 (bench/engine/workloads.py) generated at once (output tok/s), then one
request's decode at batch 1 (ms per output token, the first token excluded). Prints both per arm,
the projections' and the whole model's weight MiB, and how many greedy sequences agree; writes
quant_ab.json and quant_ab.png (with the lscpu model and flags) to --out-dir.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import workloads
from corral_engine.args import EngineArgs, parse_bytes
from corral_engine.demo_model import write_demo_model
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.llama import Linear
from corral_engine.model.runner import ModelRunner
from corral_engine.sampling_params import SamplingParams
from lora_ab import cpu_info

log = logging.getLogger("quant_ab")
MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"
# arm -> (--quantization, the checkpoint's demo --quantization: written beside --model)
ARMS: dict[str, tuple[str | None, str | None]] = {
    "plain": (None, None),
    "int8": ("int8", None),
    "awq": (None, "awq"),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--preset", default="small", help="demo preset written to --model when it is missing")
    p.add_argument("--dtype", default="bfloat16", help="the plain arm's weights; both arms' activations")
    p.add_argument("--num-requests", type=int, default=64, help="the first N of W2 (200: all of it)")
    p.add_argument("--decode-tokens", type=int, default=64, help="batch-1 output tokens per round")
    p.add_argument("--rounds", type=int, help="default 3; 1 with --quick")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="2Gi", help="each arm's KV-cache budget")
    p.add_argument("--quick", action="store_true", help="W2's --quick sizes (12 requests, outputs <= 32)")
    p.add_argument("--arms", default="plain,int8,awq", help="which of plain, int8, awq (plain first)")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/quant-ab"))
    return p.parse_args(argv)


def held_bytes(linear: Linear) -> int:
    """What one Linear holds: its weight (int8 and scales, or the plain one) and any oneDNN packed
    or float32 upcast copy the matmul plan made of it."""
    total = linear.weight.nbytes
    if linear.quant == "int4" and linear.kernel_scale is not None:  # scales and zeros
        total += linear.kernel_scale.nbytes
    elif linear.quant is not None:
        total += linear.get_buffer("weight_scale").nbytes
    elements = linear.in_features * linear.out_features
    if linear.packed is not None and linear.packed_dtype is not None:
        total += elements * linear.packed_dtype.itemsize
    if linear.upcast_packed is not None:
        total += elements * 4
    return total


def weight_mib(engine: LLMEngine) -> dict[str, float]:
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # one rank of a decoder
    model = runner.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    projections = sum(held_bytes(m) for n, m in linears.items() if n.rsplit(".", 1)[-1] in PROJECTIONS)
    others = sum(p.nbytes for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] not in PROJECTIONS)
    head = model.lm_head
    assert head is not None  # a generating model's
    extra = held_bytes(head) - head.weight.nbytes  # its packed or upcast copies
    return {"projections": projections / (1 << 20), "model": (projections + others + extra) / (1 << 20)}


def offline(
    engine: LLMEngine, requests: list[tuple[list[int], int]], tag: str
) -> tuple[float, list[list[int]]]:
    """Every request added at once, stepped to completion: output tok/s and the greedy tokens."""
    for i, (prompt, output_len) in enumerate(requests):
        engine.add_request(
            f"{tag}-{i}", prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        )
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall_s = time.perf_counter() - start
    return sum(n for _, n in requests) / wall_s, [tokens[f"{tag}-{i}"] for i in range(len(requests))]


def decode_ms(engine: LLMEngine, prompt: list[int], num_tokens: int, tag: str) -> float:
    """One request alone: the mean time of its decode steps (after the prompt's step), in ms."""
    engine.add_request(tag, prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt and the first token
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.mean(times)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    arms = {arm: ARMS[arm] for arm in args.arms.split(",")}
    if next(iter(arms)) != "plain":
        raise SystemExit("--arms must start with plain (the ratios' denominator)")
    paths = {arm: checkpoint(args, fmt) for arm, (_, fmt) in arms.items()}
    common: dict[str, Any] = {
        "dtype": args.dtype,
        "num_threads": args.threads,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_bytes": parse_bytes(args.kv_cache_memory),
        "enable_prefix_caching": False,  # rounds repeat the prompts
    }
    engines = {
        arm: LLMEngine(EngineArgs(**common, model=str(paths[arm]), quantization=q))
        for arm, (q, _) in arms.items()
    }
    records = workloads.build("W2", args.model, quick=args.quick)[: args.num_requests]
    max_len = engines["plain"].max_model_len
    requests = [(list(r["prompt"])[: max_len - int(r["output_len"])], int(r["output_len"])) for r in records]
    single = requests[0][0][:128]
    gc.collect()
    gc.freeze()  # as the offline workers and `corral engine` do after loading
    for arm, engine in engines.items():  # warm-up: first-call costs
        offline(engine, [(p, min(n, 8)) for p, n in requests[:4]], f"warm-{arm}")
    runs: dict[str, dict[str, list[float]]] = {arm: {"tok_s": [], "decode_ms": []} for arm in arms}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            tok_s, tokens[arm] = offline(engines[arm], requests, f"{arm}-{r}")
            ms = decode_ms(engines[arm], single, args.decode_tokens, f"{arm}-{r}-single")
            runs[arm]["tok_s"].append(tok_s)
            runs[arm]["decode_ms"].append(ms)
            log.info("round %d %s: %.1f tok/s offline, %.2f ms per token at batch 1", r + 1, arm, tok_s, ms)
    result = summarise(
        args, rounds, runs, tokens, {arm: weight_mib(e) for arm, e in engines.items()}, requests
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "quant_ab.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / "quant_ab.png")
    log.info("%s\nwrote %s", table(result), args.out_dir / "quant_ab.json")
    return 0


def checkpoint(args: argparse.Namespace, fmt: str | None) -> Path:
    """--model, or its `fmt` twin beside it (the same seed's weights), written once when missing."""
    path = args.model if fmt is None else args.model.with_name(f"{args.model.name}-{fmt}")
    if not (path / "config.json").is_file():
        log.info("writing the %s demo checkpoint (%s) to %s", args.preset, fmt or "plain", path)
        write_demo_model(path, preset=args.preset, quantization=fmt)
    return path


def summarise(
    args: argparse.Namespace,
    rounds: int,
    runs: dict[str, dict[str, list[float]]],
    tokens: dict[str, list[list[int]]],
    mib: dict[str, dict[str, float]],
    requests: list[tuple[list[int], int]],
) -> dict[str, Any]:
    arms = {
        arm: {
            **figures,
            "median_tok_s": statistics.median(figures["tok_s"]),
            "median_decode_ms": statistics.median(figures["decode_ms"]),
            "weight_mib": mib[arm],
        }
        for arm, figures in runs.items()
    }
    others = [arm for arm in runs if arm != "plain"]
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": rounds,
        "cpu": cpu_info(),
        "num_cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "workload": {"num_requests": len(requests), "output_tokens": sum(n for _, n in requests)},
        "arms": arms,
        # each arm against plain: per round, and how many greedy sequences it reproduced
        "tok_s_ratios": {arm: _ratios(runs, arm, "tok_s") for arm in others},
        "decode_ms_ratios": {arm: _ratios(runs, arm, "decode_ms") for arm in others},
        "identical_sequences": {
            arm: sum(a == b for a, b in zip(tokens["plain"], tokens[arm], strict=True)) for arm in others
        },
        "num_sequences": len(tokens["plain"]),
    }


def _ratios(runs: dict[str, dict[str, list[float]]], arm: str, key: str) -> list[float]:
    return [a / b for a, b in zip(runs[arm][key], runs["plain"][key], strict=True)]


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['cpu']['model_name']}, {result['args']['dtype']}, {result['workload']['num_requests']} "
        f"W2 requests, {result['rounds']} rounds",
        "| arm | offline output tok/s (median) | batch-1 ms/token (median) | projections MiB | model MiB |",
        "|---|---|---|---|---|",
    ]
    for arm, figures in result["arms"].items():
        lines.append(
            f"| {arm} | {figures['median_tok_s']:.1f} | {figures['median_decode_ms']:.2f} "
            f"| {figures['weight_mib']['projections']:.1f} | {figures['weight_mib']['model']:.1f} |"
        )
    for arm, tok in result["tok_s_ratios"].items():
        ms = result["decode_ms_ratios"][arm]
        lines.append(
            f"{arm} / plain: tok/s {statistics.median(tok):.2f}x ({min(tok):.2f}-{max(tok):.2f}), batch-1 "
            f"time {statistics.median(ms):.2f}x ({min(ms):.2f}-{max(ms):.2f}); greedy sequences identical: "
            f"{result['identical_sequences'][arm]} of {result['num_sequences']}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["arms"])
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e"][: len(names)]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    panels = (
        ("median_tok_s", "tok_s", "offline output tok/s (W2)"),
        ("median_decode_ms", "decode_ms", "batch-1 ms per token"),
    )
    for ax, (key, each, title) in zip(axes, panels, strict=False):
        ax.bar(names, [result["arms"][n][key] for n in names], color=colors)
        for i, n in enumerate(names):  # each round's figure, to show the spread
            ax.plot([i] * len(result["arms"][n][each]), result["arms"][n][each], "k.", markersize=4)
        ax.set_title(title, fontsize=9)
    axes[2].bar(names, [result["arms"][n]["weight_mib"]["projections"] for n in names], color=colors)
    axes[2].set_title("projection weights MiB (with copies)", fontsize=9)
    fig.suptitle(
        f"{' and '.join(names[1:])} vs {result['args']['dtype']}, {result['cpu']['model_name']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
