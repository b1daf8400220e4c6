"""Routing benchmark (issue 4, acceptance 6): 3 engine replicas, a workload mixing long and short
requests with shared prompt prefixes at a load near saturation, once per routing policy.

    .venv/bin/python -m bench.routing.routing_bench --load 0.85 --num-requests 600 --rounds 4

Prints a Markdown table (TTFT p50/p99, throughput, shed count, prefix-cache hit rate) and writes
`routing.json` and `routing.png` to --out. Within a round every policy sees the same arrivals and
request shapes, with its own fresh documents, so caches start cold and policies compare side by side;
the order the policies run in rotates from round to round, so a machine that speeds up or slows
down during a round favours none of them. `--load F` measures the fleet's capacity before each
round (the round's requests, closed loop, through a round-robin gateway) and offers F times it
(default 0.85): near saturation on the machine as it runs now, rather than at a fixed rate that is
under capacity one hour and over it the next. `--rate R` offers a fixed rate instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from corral_cli.bench.arrivals import arrival_offsets_s
from corral_cli.bench.runner import run_async
from corral_cli.bench.stats import RequestResult, summarize

from bench.routing.fleet import MODEL, closed_loop, engine_counter, ensure_model, open_loop, start_gateway
from bench.routing.workload import WorkloadSpec, build_requests
from e2e.procs import EngineProcess, start_engine

logger = logging.getLogger("routing_bench")
ENGINE_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total",
)
POLICIES = ("round-robin", "least-requests", "kv-aware", "prefix-affinity")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "corral" / "demo-model")
    p.add_argument("--preset", default="tiny", help="demo preset written when --model-dir is missing")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument(
        "--load",
        type=float,
        default=0.85,
        help="offer this fraction of the fleet's capacity, measured before each round (default 0.85)",
    )
    p.add_argument("--rate", type=float, help="a fixed rate in requests per second instead (Poisson)")
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--num-documents", type=int, default=16, help="shared prompt heads")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=128)
    p.add_argument("--max-queue-len", type=int, default=64, help="gateway queue per model before 429")
    p.add_argument("--rounds", type=int, default=2, help="policies run in turn this many times (noise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/routing"))
    return p.parse_args()


def summarize_run(results: list[RequestResult], duration_s: float, extra: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.is_success]
    is_shed = [r.error.startswith(("HTTP 429", "HTTP 503")) for r in results]
    ttft = summarize([r.ttft_s for r in ok])
    queries = extra.get("vllm:prefix_cache_queries_total", 0.0)
    return {
        "num_ok": len(ok),
        "num_shed": sum(is_shed),
        "num_failed": len(results) - len(ok) - sum(is_shed),
        "ttft_p50_ms": ttft["median"],
        "ttft_p99_ms": ttft["p99"],
        "output_tok_s": sum(r.output_len for r in ok) / duration_s,
        "req_s": len(ok) / duration_s,
        "prefix_hit_rate": extra.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else 0.0,
        "preemptions": extra.get("vllm:num_preemptions_total", 0.0),
        "gateway_queue_wait_s": extra.get("gateway_queue_wait_s", 0.0),
        **{k: v for k, v in extra.items() if k.startswith("gateway_retries")},
        "duration_s": duration_s,
        "errors": sorted({r.error for r, shed in zip(results, is_shed, strict=True) if r.error and not shed})[
            :5
        ],
    }


def probe_capacity(
    args: argparse.Namespace,
    backends: dict[str, list[str]],
    work_dir: Path,
    seed: int,
    count_tokens: Callable[[str], int],
) -> float:
    """Completed requests per second with the fleet kept full: the round's request shapes (fresh
    words), `replicas x max_num_seqs` at a time, through a round-robin gateway that never queues."""
    spec = WorkloadSpec(num_requests=args.num_requests // 2, num_documents=args.num_documents)
    requests = build_requests(spec, seed, count_tokens, text_seed=-seed)
    concurrency = args.replicas * args.max_num_seqs
    with start_gateway(backends, work_dir, policy="round-robin", max_queue_len=10 * concurrency) as gateway:
        results, duration_s = run_async(closed_loop(gateway.url, requests, concurrency))
    return sum(r.is_success for r in results) / duration_s


def policy_order(policies: list[str], round_index: int) -> list[str]:
    """The policies rotated by one per round: each runs first, second, ... equally often."""
    shift = round_index % len(policies)
    return policies[shift:] + policies[:shift]


def run_policy(
    args: argparse.Namespace,
    rate: float,
    policy: str,
    engines: list[EngineProcess],
    backends: dict[str, list[str]],
    work_dir: Path,
    seed: int,
    text_seed: int,
    count_tokens: Callable[[str], int],
) -> tuple[list[RequestResult], float, dict[str, float]]:
    """One run through a gateway using `policy`: arrivals and request shapes from `seed` (the same
    for every policy in a round), words from `text_seed` (fresh per run: prefix caches start cold)."""
    spec = WorkloadSpec(num_requests=args.num_requests, num_documents=args.num_documents)
    requests = build_requests(spec, seed, count_tokens, text_seed=text_seed)
    offsets = arrival_offsets_s(len(requests), rate, 1.0, seed)
    with start_gateway(backends, work_dir, policy=policy, max_queue_len=args.max_queue_len) as gateway:
        run_async(open_loop(gateway.url, requests[:6], [0.0] * 6))  # warm-up
        before = {name: engine_counter(engines, name) for name in ENGINE_COUNTERS}
        results, duration_s = run_async(open_loop(gateway.url, requests, offsets))
        extra = {name: engine_counter(engines, name) - before[name] for name in ENGINE_COUNTERS}
        extra["gateway_queue_wait_s"] = gateway.metric("corral_gateway_queue_wait_seconds_sum")
        for labels, value in gateway.metrics().get("corral_gateway_retries_total", []):
            extra[f"gateway_retries_{labels['reason']}"] = value
    return results, duration_s, extra


def merge(
    runs: list[tuple[list[RequestResult], float, dict[str, float]]],
) -> tuple[list[RequestResult], float, dict[str, float]]:
    results = [r for run in runs for r in run[0]]
    extra: dict[str, float] = {}
    for run in runs:
        for key, value in run[2].items():
            extra[key] = extra.get(key, 0.0) + value
    return results, sum(run[1] for run in runs), extra


def add_paired_ratios(
    rows: dict[str, dict[str, Any]], rounds: dict[str, list[dict[str, Any]]], baseline: str = "round-robin"
) -> None:
    """Per round, each policy's p99 TTFT and throughput over the baseline's in the same round (same
    arrivals); the median over rounds goes into `rows`. On a noisy machine the fleet's capacity
    drifts between rounds, so these paired ratios are steadier than ratios of pooled figures."""
    base = rounds.get(baseline)
    if not base:
        return
    for policy, runs in rounds.items():
        p99 = [
            r["ttft_p99_ms"] / b["ttft_p99_ms"] for r, b in zip(runs, base, strict=True) if b["ttft_p99_ms"]
        ]
        tput = [
            r["output_tok_s"] / b["output_tok_s"]
            for r, b in zip(runs, base, strict=True)
            if b["output_tok_s"]
        ]
        rows[policy]["p99_vs_baseline_pooled"] = rows[policy]["ttft_p99_ms"] / rows[baseline]["ttft_p99_ms"]
        rows[policy]["p99_vs_baseline_per_round"] = p99
        rows[policy]["p99_vs_baseline_median"] = statistics.median(p99) if p99 else float("nan")
        rows[policy]["tput_vs_baseline_median"] = statistics.median(tput) if tput else float("nan")


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| policy | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | req/s | shed | failed | prefix hit rate "
        "| preemptions | p99 / round-robin | p99 / round-robin (median of rounds) | tok/s / round-robin |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nan = float("nan")
    for policy, r in rows.items():
        lines.append(
            f"| {policy} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['output_tok_s']:.0f} | "
            f"{r['req_s']:.2f} | {r['num_shed']} | {r['num_failed']} | {r['prefix_hit_rate']:.2f} | "
            f"{r.get('preemptions', 0):.0f} | "
            f"{r.get('p99_vs_baseline_pooled', nan):.2f}x | {r.get('p99_vs_baseline_median', nan):.2f}x | "
            f"{r.get('tput_vs_baseline_median', nan):.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [rows[n]["ttft_p99_ms"] for n in names], alpha=0.5, label="p99")
    axes[0].bar(names, [rows[n]["ttft_p50_ms"] for n in names], label="p50")
    axes[0].set_title("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(names, [rows[n]["output_tok_s"] for n in names])
    axes[1].set_title("output tokens / s")
    axes[2].bar(names, [rows[n]["num_shed"] for n in names])
    axes[2].set_title("shed (429/503)")
    axes[2].set_ylim(bottom=0, top=max(1, *(rows[n]["num_shed"] for n in names)) * 1.1)
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from tokenizers import Tokenizer

    model_dir = ensure_model(args.model_dir, args.preset)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    flags = {
        "served_model_name": MODEL,
        "max_num_seqs": args.max_num_seqs,
        "num_kv_blocks": args.num_kv_blocks,
        "num_threads": 1,  # 3 replicas share this machine's cores
    }
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-bench-")))
        engines = [
            stack.enter_context(start_engine(model_dir, log_dir=work_dir, **flags))
            for _ in range(args.replicas)
        ]
        backends = {MODEL: [e.url for e in engines]}
        runs: dict[str, list[tuple[list[RequestResult], float, dict[str, float]]]] = {}
        rates: list[float] = []
        for round_index in range(args.rounds):
            seed = args.seed + 1 + round_index  # one arrival pattern per round, shared by the policies
            rate = args.rate
            if rate is None:
                capacity = probe_capacity(args, backends, work_dir, seed, count_tokens)
                rate = args.load * capacity
                logger.info("round %d: capacity %.1f req/s, offering %.1f req/s", round_index, capacity, rate)
            rates.append(rate)
            for policy in policy_order(list(args.policies), round_index):
                text_seed = (
                    1000 * (args.seed + 1) + args.policies.index(policy) + round_index * len(args.policies)
                )
                runs.setdefault(policy, []).append(
                    run_policy(args, rate, policy, engines, backends, work_dir, seed, text_seed, count_tokens)
                )
                logger.info("%s round %d: %s", policy, round_index, summarize_run(*runs[policy][-1]))
        runs = {policy: runs[policy] for policy in args.policies}  # table rows in the order given
        rows = {policy: summarize_run(*merge(policy_runs)) for policy, policy_runs in runs.items()}
        rounds = {
            policy: [summarize_run(*run) for run in policy_runs] for policy, policy_runs in runs.items()
        }
    add_paired_ratios(rows, rounds)
    text = table(rows)
    (args.out / "routing.json").write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out), "model_dir": str(model_dir)},
                "rows": rows,
                "rounds": rounds,
                "rates": rates,
            },
            indent=2,
        )
    )
    (args.out / "routing.md").write_text(text + "\n")
    plot(rows, args.out / "routing.png")
    logger.info("results in %s\n%s", args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
