"""Issue 22's GPU acceptance and benchmark run, one command on a bare GPU machine:

    PYTHONPATH=engine:cli python3 -m bench.gpu.acceptance --out DIR [--phases env,equality,...]
    PYTHONPATH=engine:cli python3 -m bench.gpu.acceptance --smoke --out DIR      # the same on CPU, seconds
    PYTHONPATH=engine:cli python3 -m bench.gpu.acceptance --smoke --device cuda --out DIR  # GPU, a minute
    python3 -m bench.gpu.acceptance --merge A/gpu-acceptance.json B/gpu-acceptance.json --out DIR

Phases, in this order whatever order they are named in: env, bandwidth, equality, batch1, overhead,
throughput, served, lora, quant, int4. Writes gpu-acceptance.json (after every phase, so a run cut short keeps
what finished), gpu-*.png and table.md into --out; --merge joins the JSON of runs split across
calls and redraws.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu import phases, plots, report
from bench.gpu.context import GPU, SMOKE, Profile, Run
from bench.gpu.int4 import int4
from bench.gpu.lora import lora
from bench.gpu.quant import quant
from bench.gpu.served import served
from bench.gpu.throughput import SYSTEMS, ratios, throughput

log = logging.getLogger("gpu")

RESULT_FILE = "gpu-acceptance.json"
PHASES: dict[str, Callable[..., dict[str, Any]]] = {
    "env": phases.env,
    "bandwidth": phases.bandwidth,
    "equality": phases.equality,
    "batch1": phases.batch1,
    "overhead": phases.overhead,
    "throughput": throughput,
    "served": served,
    "lora": lora,
    "quant": quant,
    "int4": int4,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON, PNGs and table.md")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of: {', '.join(PHASES)}")
    p.add_argument("--smoke", action="store_true", help="the tiny preset and a handful of tokens, in seconds")
    p.add_argument("--device", help="cuda or cpu (default: cuda; cpu with --smoke)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="throughput phase's systems")
    p.add_argument(
        "--models-dir",
        type=Path,
        default=Path("/tmp/corral-gpu-models"),
        help="where demo checkpoints are written once and reused",
    )
    p.add_argument(
        "--commit", help="the engine's commit, recorded (default: git rev-parse, if a .git is here)"
    )
    p.add_argument("--batch1-preset", help="preset of batch1 and overhead (GPU default: llama3-8b)")
    p.add_argument("--throughput-preset", help="preset of the throughput phase (GPU default: llama3-8b)")
    p.add_argument("--hf-w1-batch-sizes", help="transformers static batch sizes on W1 (GPU default: 32,64)")
    p.add_argument("--hf-w2-batch-sizes", help="... on W2 (GPU default: 64,128)")
    p.add_argument(
        "--hf-budget-s",
        type=float,
        help="seconds per static workload and batch size before it reports its pace (GPU: 150)",
    )
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="join these runs' results instead")
    return p.parse_args(argv)


def _profile(args: argparse.Namespace) -> Profile:
    profile = SMOKE if args.smoke else GPU
    changes: dict[str, Any] = {}
    if args.device:
        changes["device"] = args.device
    if args.batch1_preset:
        changes["batch1_preset"] = args.batch1_preset
    if args.throughput_preset:
        changes["throughput_preset"] = args.throughput_preset
    sizes = dict(profile.hf_batch_sizes)
    for name, given in (("W1", args.hf_w1_batch_sizes), ("W2", args.hf_w2_batch_sizes)):
        if given:
            sizes[name] = tuple(int(b) for b in given.split(","))
    changes["hf_batch_sizes"] = sizes
    if args.hf_budget_s is not None:
        changes["hf_budget_s"] = args.hf_budget_s
    return dataclasses.replace(profile, **changes)


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def run_phases(args: argparse.Namespace) -> dict[str, Any]:
    profile = _profile(args)
    names = [n for n in PHASES if n in args.phases.split(",")]
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phases: {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    if profile.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --smoke for the CPU version")
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    results: dict[str, Any] = {
        "schema": 1,
        "mode": "smoke" if args.smoke else "gpu",
        "commit": args.commit or _git_commit(),
        "profile": dataclasses.asdict(profile),
        "runs": [{"started": started, "phases": names, "argv": sys.argv[1:]}],
        "phases": {},
    }
    run = Run(profile, args.models_dir)
    systems = tuple(s for s in args.systems.split(",") if s)
    for name in names:
        log.info("== phase %s", name)
        t0 = time.perf_counter()
        try:
            extra = {"systems": systems} if name == "throughput" else {}
            figures = PHASES[name](run, results["phases"], **extra)
        except Exception as e:  # a failed phase is a result; the next phases still run
            log.exception("phase %s failed", name)
            figures = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        figures["phase_s"] = time.perf_counter() - t0
        results["phases"][name] = figures
        log.info("== phase %s done in %.1f s", name, figures["phase_s"])
        write(results, args.out)
    run.release()
    return results


def merge(paths: list[Path]) -> dict[str, Any]:
    """Runs split across calls, joined: later runs' phases replace earlier ones of the same name,
    except throughput, whose systems join (calls B and C of the README measure different systems
    on the same workloads) and whose ratios are taken again over all of them."""
    loaded = [json.loads(p.read_text()) for p in paths]
    merged = dict(loaded[0])
    merged["runs"] = [r for one in loaded for r in one.get("runs", [])]
    merged["phases"] = {}
    for one in loaded:
        for name, figures in one.get("phases", {}).items():
            earlier = merged["phases"].get(name)
            if name == "throughput" and earlier is not None and "systems" in earlier and "systems" in figures:
                systems = {**earlier["systems"], **figures["systems"]}
                figures = {**earlier, **figures, "systems": systems, "ratios": ratios(systems)}
            merged["phases"][name] = figures
    return merged


def write(results: dict[str, Any], out: Path) -> None:
    results["targets"] = report.targets(results)
    (out / RESULT_FILE).write_text(json.dumps(results, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = merge(args.merge) if args.merge else run_phases(args)
    write(results, args.out)
    written = plots.plot_all(results, args.out)
    table = report.markdown(results)
    (args.out / "table.md").write_text(table)
    log.info(
        "wrote %s, %s and table.md to %s\n%s",
        RESULT_FILE,
        ", ".join(p.name for p in written),
        args.out,
        table,
    )
    failed = [n for n, f in results["phases"].items() if "error" in f]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
