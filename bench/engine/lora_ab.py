"""What LoRA adapters cost in offline throughput, every arm in one process, side by side.

    .venv/bin/python bench/engine/lora_ab.py [--rounds 3] [--num-requests 64] [--dtype bfloat16]
    .venv/bin/python bench/engine/lora_ab.py --quick --model /tmp/tiny --preset tiny   # seconds

Two offline engines on the small demo checkpoint (written there once when missing): one without
--enable-lora, one with it (max_loras 4, eight rank-16 demo adapters on all seven targets). Arms:
no-lora; lora-base (the LoRA engine, no request names an adapter); lora-1 (every request on one
adapter); lora-4 (round-robin over 4); lora-8 (round-robin over 8 with 4 slots: adapters swap in
and out, and a request whose adapter would be a fifth waits); opt-in: no-lora-no-stack (the
native decode stack off), lora-1-model-dtype and lora-4-model-dtype (a third engine whose slots
keep the model's dtype, CORRAL_LORA_UPCAST=0: the A/B of float32 slots). Each run generates the first
--num-requests of W2 (bench/engine/workloads.py) with one generate-like loop; the arms' order
rotates every round, so a drifting machine favours none. Prefix caching is off: rounds repeat the
prompts. Prints output tok/s per arm (median of rounds) and ratios to no-lora; writes lora_ab.json
and lora_ab.png (with the lscpu model and flags) to --out-dir.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workloads
from corral_engine.args import EngineArgs
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.demo_model import write_demo_model
from corral_engine.llm_engine import LLMEngine
from corral_engine.lora import LoraRequest, startup_adapters
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger("lora_ab")
MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"
NUM_ADAPTERS = 8


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    uses_lora_engine: bool
    num_adapters: int  # requests spread round-robin over this many adapters; 0: base model
    has_decode_stack: bool = True  # False: the native decode stack off for the run (LoRA had it so)
    # True: a third engine, LoRA slots in the model's dtype (CORRAL_LORA_UPCAST=0), for the A/B of
    # float32 slots where bf16 is upcast.
    model_dtype_slots: bool = False

    @property
    def engine_key(self) -> str:
        return "lora-model-dtype" if self.model_dtype_slots else "lora" if self.uses_lora_engine else "plain"


ARMS = {
    arm.name: arm
    for arm in (
        Arm("no-lora", False, 0),
        Arm("lora-base", True, 0),
        Arm("lora-1", True, 1),
        Arm("lora-4", True, 4),
        Arm("lora-8", True, 8),
        # Diagnostic (opt-in, --arms): the native decode stack off.
        Arm("no-lora-no-stack", False, 0, has_decode_stack=False),
        # Opt-in (--arms): the adapter arms with slots in the model's dtype (CORRAL_LORA_UPCAST=0).
        Arm("lora-1-model-dtype", True, 1, model_dtype_slots=True),
        Arm("lora-4-model-dtype", True, 4, model_dtype_slots=True),
    )
}
DEFAULT_ARMS = "no-lora,lora-base,lora-1,lora-4,lora-8"
_COLORS = {
    "no-lora": "#7f7f7f",
    "lora-base": "#6baed6",
    "lora-1": "#1f77b4",
    "lora-4": "#2ca02c",
    "lora-8": "#d62728",
}
SMALL_BATCH = 8  # decode steps of fewer rows: where the native decode stack runs, when planned


class SlotLoads:
    """Counts an engine's adapter loads into its LoRA slots (the engine keeps no such count)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.count = 0
        slots: Any = getattr(engine.runner, "lora", None)
        if slots is not None:
            load = slots._load

            def counted(*args: Any) -> None:
                self.count += 1
                load(*args)

            slots._load = counted


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--preset", default="small", help="demo preset written to --model when it is missing")
    p.add_argument("--dtype", default="bfloat16", help="as compare.py runs the engine")
    p.add_argument("--num-requests", type=int, default=64, help="the first N of W2 (200: all of it)")
    p.add_argument("--rounds", type=int, help="default 3; 1 with --quick")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of: {', '.join(ARMS)}")
    p.add_argument("--quick", action="store_true", help="W2's --quick sizes (12 requests, outputs <= 32)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/lora-ab"))
    return p.parse_args(argv)


def cpu_info() -> dict[str, str]:
    """lscpu's model name and flags (the CPU features that decide the matmul paths)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30, check=False).stdout
    except OSError:
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {
        "model_name": fields.get("Model name", "?").strip(),
        "flags": fields.get("Flags", "?").strip(),
    }


def build_engines(
    args: argparse.Namespace, adapter_dirs: list[Path], arms: list[Arm]
) -> dict[str, LLMEngine]:
    """The engine without --enable-lora ("plain"), the one with it ("lora") and, when an arm asks
    for it, one with LoRA slots in the model's dtype ("lora-model-dtype"); same settings else."""
    common: dict[str, Any] = {
        "model": str(args.model),
        "dtype": args.dtype,
        "num_threads": args.threads,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_bytes": 2 << 30,
        "enable_prefix_caching": False,
    }
    modules = tuple(f"a{i}={path}" for i, path in enumerate(adapter_dirs))
    lora = EngineArgs(**common, enable_lora=True, lora_modules=modules, max_loras=4, max_lora_rank=args.rank)
    engines = {"plain": LLMEngine(EngineArgs(**common)), "lora": LLMEngine(lora)}
    if any(arm.model_dtype_slots for arm in arms):
        engines["lora-model-dtype"] = LLMEngine(lora, EngineSettings(lora_upcast="0"))
    return engines


def run_arm(
    engine: LLMEngine,
    arm: Arm,
    loras: list[LoraRequest],
    requests: list[tuple[list[int], int]],
    loads: SlotLoads | None,
) -> dict[str, Any]:
    """One timed run: every request added at once, stepped to completion; tok/s and batch shape."""
    for i, (prompt, output_len) in enumerate(requests):
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        lora = loras[i % arm.num_adapters] if arm.num_adapters else None
        engine.add_request(f"{arm.name}-{i}", prompt, params, lora=lora)
    loads_before = 0 if loads is None else loads.count
    num_steps = num_rows = num_small = 0
    small_s = 0.0
    tokens: dict[str, list[int]] = {}
    model = engine.runner.model  # type: ignore[union-attr]
    stack = model.decode_stack
    if not arm.has_decode_stack:
        model.decode_stack = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        num_steps += 1
        num_rows += len(engine.last_schedule)
        if len(engine.last_schedule) < SMALL_BATCH:
            num_small += 1
            small_s += time.perf_counter() - t0
    wall_s = time.perf_counter() - start
    model.decode_stack = stack
    num_out = sum(n for _, n in requests)
    figures: dict[str, Any] = {
        "tok_s": num_out / wall_s,
        "wall_s": wall_s,
        "num_steps": num_steps,
        "mean_seqs_per_step": num_rows / max(num_steps, 1),
        "num_small_steps": num_small,
        "small_steps_s": small_s,
        "tokens": [tokens[f"{arm.name}-{i}"] for i in range(len(requests))],
    }
    if loads is not None:
        figures["slot_loads"] = loads.count - loads_before
    return figures


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    arms = [ARMS[name] for name in args.arms.split(",")]
    if arms[0].name != "no-lora":
        raise SystemExit("--arms starts with no-lora: the ratios are to it")
    if not (args.model / "config.json").is_file():
        log.info("writing the %s demo checkpoint to %s", args.preset, args.model)
        write_demo_model(args.model, preset=args.preset)
    adapter_dirs = [
        write_demo_adapter(args.model, args.out_dir / "adapters" / f"a{i}", rank=args.rank, seed=i + 1)
        for i in range(NUM_ADAPTERS)
    ]
    engines = build_engines(args, adapter_dirs, arms)
    records = workloads.build("W2", args.model, quick=args.quick)[: args.num_requests]
    max_len = engines["plain"].max_model_len  # the tiny preset's 512 positions cut W2's longest
    requests = [(list(r["prompt"])[: max_len - int(r["output_len"])], int(r["output_len"])) for r in records]
    loads = {key: SlotLoads(engine) if key != "plain" else None for key, engine in engines.items()}
    loras = startup_adapters(engines["lora"].args.lora_modules)  # ids as the engine registered them
    gc.collect()
    gc.freeze()  # as the offline workers and `corral engine` do after loading
    warm = [(prompt, min(n, 16)) for prompt, n in requests[:4]]  # short: first-call costs only
    for arm in arms:  # warm-up: first-call costs, every adapter into a slot once
        run_arm(engines[arm.engine_key], arm, loras, warm, loads[arm.engine_key])
    runs: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=args.no_progress) as progress:
        task = progress.add_task("runs", total=args.rounds * len(arms))
        for round_index in range(args.rounds):
            shift = round_index % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                progress.update(task, description=f"round {round_index + 1} {arm.name}")
                figures = run_arm(engines[arm.engine_key], arm, loras, requests, loads[arm.engine_key])
                runs[arm.name].append(figures)
                progress.advance(task)
                log.info("round %d %s: %.1f tok/s", round_index + 1, arm.name, figures["tok_s"])
            partial = summarise(args, {a.name: runs[a.name][: round_index + 1] for a in arms}, requests)
            write(partial, args.out_dir)  # a run cut short keeps its finished rounds
    result = summarise(args, runs, requests)
    write(result, args.out_dir)
    plot(result, args.out_dir / "lora_ab.png")
    log.info("%s\nwrote %s", table(result), args.out_dir / "lora_ab.json")
    return 0


def write(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lora_ab.json").write_text(json.dumps(result, indent=2) + "\n")


def summarise(
    args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], requests: list[tuple[list[int], int]]
) -> dict[str, Any]:
    base = runs["no-lora"]
    arms: dict[str, Any] = {}
    for arm in map(ARMS.__getitem__, runs):
        rounds = runs[arm.name]
        tok_s = [r["tok_s"] for r in rounds]
        ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(rounds, base, strict=True)]
        arms[arm.name] = {
            "num_adapters": arm.num_adapters,
            "lora_engine": arm.uses_lora_engine,
            "tok_s": tok_s,
            "median_tok_s": statistics.median(tok_s),
            "ratios_to_no_lora": ratios,
            "median_ratio": statistics.median(ratios),
            "mean_seqs_per_step": statistics.median(r["mean_seqs_per_step"] for r in rounds),
            "num_steps": statistics.median(r["num_steps"] for r in rounds),
            "slot_loads": [r.get("slot_loads") for r in rounds],
            "num_small_steps": statistics.median(r["num_small_steps"] for r in rounds),
            "median_small_steps_s": statistics.median(r["small_steps_s"] for r in rounds),
            "median_wall_s": statistics.median(r["wall_s"] for r in rounds),
        }
    # Same greedy tokens with --enable-lora and no adapter: the base path must be unchanged.
    other = runs.get("lora-base", base)
    same = [a == b for a, b in zip(base[-1]["tokens"], other[-1]["tokens"], strict=True)]
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "cpu": cpu_info(),
        "num_cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "workload": {
            "num_requests": len(requests),
            "input_tokens": sum(len(p) for p, _ in requests),
            "output_tokens": sum(n for _, n in requests),
        },
        "arms": arms,
        "lora_base_identical_sequences": sum(same),
        "lora_base_identical_of": len(same),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['cpu']['model_name']}, {result['args']['dtype']}, {result['workload']['num_requests']} "
        f"W2 requests, {result['args']['rounds']} rounds",
        "| arm | output tok/s (median) | / no-lora (median, range) | seqs per step | slot loads "
        f"| steps < {SMALL_BATCH} rows: count, s |",
        "|---|---|---|---|---|---|",
    ]
    for name, arm in result["arms"].items():
        ratios = arm["ratios_to_no_lora"]
        loads = ",".join("-" if x is None else str(x) for x in arm["slot_loads"])
        lines.append(
            f"| {name} | {arm['median_tok_s']:.1f} | {arm['median_ratio']:.3f}x "
            f"({min(ratios):.3f}-{max(ratios):.3f}) | {arm['mean_seqs_per_step']:.1f} | {loads} "
            f"| {arm['num_small_steps']:.0f}, {arm['median_small_steps_s']:.1f} |"
        )
    lines.append(
        f"lora-base greedy tokens equal no-lora's: {result['lora_base_identical_sequences']} of "
        f"{result['lora_base_identical_of']} sequences"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["arms"])
    fig, ax = plt.subplots(figsize=(8, 4))
    medians = [result["arms"][n]["median_tok_s"] for n in names]
    bars = ax.bar(names, medians, color=[_COLORS.get(n, "#9467bd") for n in names])
    labels = [f"{result['arms'][n]['median_ratio']:.2f}x" for n in names]
    ax.bar_label(bars, labels=labels, fontsize=8)
    for i, n in enumerate(names):  # each round's figure, to show the spread
        ax.plot([i] * len(result["arms"][n]["tok_s"]), result["arms"][n]["tok_s"], "k.", markersize=4)
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.set_title(f"LoRA offline throughput, {result['cpu']['model_name']} ({result['args']['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
