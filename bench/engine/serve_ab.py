"""The served engine at two revisions, side by side: where the HTTP front's CPU goes per token.

    .venv/bin/python -m bench.engine.serve_ab [--base HEAD] [--preset tiny] [--rounds 8]

Starts two `corral engine` processes on the same cores, one running `--base` (a git revision,
unpacked aside) and one running the working tree, and drives each in turn with the same closed
loop (`--concurrency` streams, each sending its next request as soon as the last one ended;
`--num-requests` of a short prompt and `--output-tokens` tokens, ignore_eos). The order flips every
round, so a drifting machine favours neither; the figures are medians of per-round ratios
(working tree / base). The load client runs on the other cores.

Per round and engine it reports output tok/s, median and p99 time to first token, and the CPU per
output token of the engine's event-loop thread (HTTP, SSE, tokenization) and of its other threads
(the step loop and the model's). With a small model the event loop's share is large, which is
what a GPU serving thousands of tokens per second meets too. Writes serve_ab.json and
serve_ab.png to --out.

`--base-env NAME=VALUE` / `--tree-env NAME=VALUE` set a variable for one arm's engine, so one
revision can run against itself under two settings (`--base tree --base-env
CORRAL_ENGINE_PROCESS=0 --tree-env CORRAL_ENGINE_PROCESS=1`: the working tree in both arms, no git
needed, as on the GPU machine); `--engine-cpus all` lets the engines
use every core (the client still runs on the lower half), `--threads` sets their model threads,
`--engine-arg NAME=VALUE` passes an engine flag to both (two engines sharing one GPU each need
`gpu_memory_utilization=0.4`).
The CPU of an engine's child processes (an engine core in its own process) is counted apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from corral_cli.bench.runner import run_async
from corral_cli.bench.stats import RequestResult

from bench.experiments import source
from bench.routing.fleet import (
    MODEL,
    add_closed_loop_args,
    closed_loop,
    ensure_model,
    env_pairs,
    start_loop_engine,
    stream_requests,
    thread_cpu_seconds,
)

logger = logging.getLogger("serve_ab")
ARMS = ("base", "tree")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--base",
        default="HEAD",
        help="git revision to compare the working tree with (`tree`: the working tree, with --base-env)",
    )
    p.add_argument(
        "--base-env", action="append", default=[], metavar="NAME=VALUE", help="set for the base's engine"
    )
    p.add_argument(
        "--tree-env", action="append", default=[], metavar="NAME=VALUE", help="set for the tree's engine"
    )
    p.add_argument(
        "--engine-cpus",
        choices=["half", "all"],
        default="half",
        help="the engines on the upper half of the cores (the client on the rest), or on all of them",
    )
    p.add_argument("--threads", type=int, help="model threads per engine (default: one per engine core)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an engine flag for both arms by its python name (gpu_memory_utilization=0.4: two on one GPU)",
    )
    add_closed_loop_args(p)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=0,
        help="full untimed rounds per arm before the timed ones (beyond the first `--concurrency` requests)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/serve-ab"))
    return p.parse_args()


def round_summary(
    results: list[RequestResult], duration_s: float, cpu_s: dict[str, float]
) -> dict[str, float]:
    ok = [r for r in results if r.is_success]
    failed = [r for r in results if not r.is_success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0].error}")
    num_tokens = sum(r.output_len for r in ok)
    ttfts = sorted(r.ttft_s for r in ok)
    return {
        "output_tok_s": num_tokens / duration_s,
        "median_ttft_ms": statistics.median(ttfts) * 1000,
        "p99_ttft_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000,
        "event_loop_us_per_token": cpu_s["event_loop"] / num_tokens * 1e6,
        "other_us_per_token": cpu_s["other"] / num_tokens * 1e6,
        "event_loop_cores": cpu_s["event_loop"] / duration_s,
        # An engine core in a process of its own (CORRAL_ENGINE_PROCESS=1): the step loop and model.
        "core_process_us_per_token": cpu_s["children"] / num_tokens * 1e6,
    }


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per measure: each arm's median, and the median, q1 and q3 of the per-round ratios tree/base."""
    summary: dict[str, dict[str, float]] = {}
    for key in runs["base"][0]:
        ratios = [
            t[key] / b[key] if b[key] else float("nan")
            for b, t in zip(runs["base"], runs["tree"], strict=True)
        ]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        summary[key] = {
            "base": statistics.median(r[key] for r in runs["base"]),
            "tree": statistics.median(r[key] for r in runs["tree"]),
            "ratio": statistics.median(ratios),
            "ratio_q1": q1,
            "ratio_q3": q3,
        }
    return summary


def table(summary: dict[str, dict[str, float]], base: str) -> str:
    rows = []
    for key, s in summary.items():
        spread = f"{s['ratio']:.3f} ({s['ratio_q1']:.3f}-{s['ratio_q3']:.3f})"
        rows.append(f"| {key} | {s['base']:.1f} | {s['tree']:.1f} | {spread} |")
    head = f"| measure | base ({base}) | working tree | tree / base, median (IQR) |"
    return "\n".join([head, "|---|---:|---:|---:|", *rows])


def plot(runs: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    keys = ("output_tok_s", "median_ttft_ms", "event_loop_us_per_token", "other_us_per_token")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4))
    for ax, key in zip(axes, keys, strict=True):
        for arm in ARMS:
            ax.plot([r[key] for r in runs[arm]], marker="o", label=arm)
        ax.set_title(key)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model_dir = ensure_model(args.model_dir, args.preset)
    requests = stream_requests(args.num_requests, args.output_tokens)
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    engine_cpus, client_cpus = set(cpus[-half:]), set(cpus[:-half] or cpus)
    if args.engine_cpus == "all":
        engine_cpus = set(cpus)
    envs = {"base": env_pairs(args.base_env), "tree": env_pairs(args.tree_env)}
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-serve-ab-")))
        base = source.working_tree() if args.base == "tree" else source.from_revision(args.base, work_dir)
        sources = {"base": base, "tree": source.working_tree()}
        engines = {
            arm: stack.enter_context(
                start_loop_engine(
                    model_dir,
                    work_dir,
                    MODEL,
                    args.concurrency,
                    engine_cpus,
                    {**(sources[arm].env or {}), **envs[arm]},
                    num_threads=args.threads,
                    **env_pairs(args.engine_arg),
                )
            )
            for arm in ARMS
        }
        os.sched_setaffinity(0, client_cpus)
        for arm in ARMS:  # warm-up: kernels compiled for the shapes the rounds meet, caches grown
            run_async(closed_loop(engines[arm].url, requests[: args.concurrency], args.concurrency))
            for _ in range(args.warmup_rounds):
                run_async(closed_loop(engines[arm].url, requests, args.concurrency))
        for round_index in range(args.rounds):
            for arm in ARMS if round_index % 2 == 0 else ARMS[::-1]:
                pid = engines[arm].proc.pid
                before = thread_cpu_seconds(pid)
                results, duration_s = run_async(closed_loop(engines[arm].url, requests, args.concurrency))
                after = thread_cpu_seconds(pid)
                used = {k: after[k] - before[k] for k in after}
                runs[arm].append(round_summary(results, duration_s, used))
                logger.info("round %d %s: %s", round_index, arm, runs[arm][-1])
    summary = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "base": sources["base"].description,
        "tree": sources["tree"].description,
        "base_env": envs["base"],
        "tree_env": envs["tree"],
        "engine_cpus": sorted(engine_cpus),
        "client_cpus": sorted(client_cpus),
        "args": {k: str(v) for k, v in vars(args).items()},
        "engine_args": env_pairs(args.engine_arg),
        "runs": runs,
        "summary": summary,
    }
    (args.out / "serve_ab.json").write_text(json.dumps(report, indent=2))
    plot(runs, args.out / "serve_ab.png")
    logger.info("results in %s\n%s", args.out, table(summary, sources["base"].description))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
