"""Gateway overhead benchmark (issue 4, acceptance 7): N concurrent streams through the gateway versus
straight to the same engine; plus one-at-a-time 1-token requests, which isolate the proxy's added
latency from engine batching noise. It also reports the CPU the engine, the gateway and the load
client used.

Where the processes run (`--layout`): in a cluster the gateway runs in its own pod, not on the
engine's cores nor the client's. `gateway-alone` (the default) comes closest on one machine: the
gateway gets the lower half of the cores to itself, the engine (with as many threads as cores) and
the load client share the upper half, the same way whether the streams go straight to the engine or
through the gateway, so the ratio isolates what the extra hop costs. `split` gives the engine the
upper half and the gateway and client the lower, so through the gateway the client loses CPU it
has to itself when going direct; `shared` lets all three run on every core, so on a small machine
the gateway's and the client's CPU comes out of the engine's (docs/gateway-bench.md has all three).

Shared cloud machines change speed by tens of percent from minute to minute, more than the
difference being measured. So the comparison is paired: many short rounds, each running both
targets back to back (direct first in even rounds, the gateway first in odd ones, so a steady drift
favours neither), and the figures are medians of the per-round ratios. Probes alternate the same way,
one direct and one through the gateway, and the added latency is the median of the pairs'
differences. Even so, one round's ratio spreads by +-5-10% here, so the median wants many rounds.
Two arrangements run both arms at once instead (docs/gateway-bench.md says what each can show):
twin rounds start a second engine on the same cores and send half the streams straight to one
engine and half through the gateway to the other (which engine is behind the gateway swaps every
round), with calibration rounds where both halves go straight; mixed rounds send both halves into
one engine, which resolves a fraction of a percent but is biased against the gateway by the
engine's first-come-first-served intake.

    .venv/bin/python -m bench.routing.overhead_bench --concurrency 100 --num-requests 600 --rounds 8

Prints a Markdown table and writes `overhead.json` to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from corral_cli.bench.client import RequestSettings, send_request
from corral_cli.bench.runner import make_client, run_async
from corral_cli.bench.stats import RequestResult
from corral_cli.bench.workload import BenchRequest

from bench.routing.fleet import (
    MODEL,
    REQUEST_TIMEOUT_S,
    add_closed_loop_args,
    closed_loop,
    cpu_seconds,
    ensure_model,
    start_gateway,
    start_loop_engine,
    stream_requests,
)

logger = logging.getLogger("overhead_bench")
TWIN_MODEL = MODEL + "-twin"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_closed_loop_args(p)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--num-probes", type=int, default=200, help="sequential 1-token requests per target")
    p.add_argument(
        "--twin-rounds",
        type=int,
        default=16,
        help="rounds with half the streams straight to one engine and half through the gateway to a twin "
        "engine on the same cores, at once",
    )
    p.add_argument(
        "--twin-aa-rounds",
        type=int,
        default=8,
        help="calibration: twin rounds with both halves straight to their engine (the ratio's noise)",
    )
    p.add_argument(
        "--mixed-rounds",
        type=int,
        default=0,
        help="rounds with half the streams straight to the engine and half through the gateway to the "
        "same engine, at once (precise but biased against the gateway; see mixed_round)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/overhead"))
    p.add_argument(
        "--layout",
        choices=("gateway-alone", "split", "shared"),
        default="gateway-alone",
        help="gateway-alone: the gateway on half the cores, the engine and the client on the other half "
        "(as in a cluster, where the gateway runs in its own pod); split: the engine on half the cores, "
        "the gateway and the client on the other half; shared: all three on every core",
    )
    p.add_argument(
        "--gateway-setting", action="append", default=[], metavar="KEY=YAML", help="extra gateway setting"
    )
    return p.parse_args()


def streams_summary(
    results: list[RequestResult], duration_s: float, cpu_s: dict[str, float]
) -> dict[str, float]:
    ok = [r for r in results if r.is_success]
    num_tokens = sum(r.output_len for r in ok)
    return {
        "num_ok": len(ok),
        "output_tok_s": num_tokens / duration_s,
        # Cores each process kept busy during the run, and the gateway's CPU per forwarded token.
        "engine_cores": cpu_s["engine"] / duration_s,
        "gateway_cores": cpu_s["gateway"] / duration_s,
        "client_cores": cpu_s["client"] / duration_s,
        "gateway_cpu_us_per_token": cpu_s["gateway"] / max(1, num_tokens) * 1e6,
        "median_e2el_ms": statistics.median(r.e2el_s for r in ok) * 1000,
        "median_ttft_ms": statistics.median(r.ttft_s for r in ok) * 1000,
    }


@dataclass(frozen=True)
class Placement:
    """The cores each process may run on."""

    engine: set[int]
    gateway: set[int]
    client: set[int]


def place(layout: str) -> Placement:
    cpus = sorted(os.sched_getaffinity(0))
    if layout == "shared" or len(cpus) < 2:
        return Placement(set(cpus), set(cpus), set(cpus))
    half = len(cpus) // 2
    lower, upper = set(cpus[:half]), set(cpus[half:])
    if layout == "split":
        return Placement(engine=upper, gateway=lower, client=lower)
    return Placement(engine=upper, gateway=lower, client=upper)


async def mixed_round(
    direct_url: str, gateway_url: str, requests: list[BenchRequest], concurrency: int, parity: int = 0
) -> dict[str, float]:
    """Half the streams straight to the engine, half through the gateway, at the same time into the
    same engine batches, so the machine's drift hits both alike. The clients alternate (with parity
    0 the even ones go direct, the odd ones through the gateway; parity 1 swaps them) and take their
    requests from one shared list, so neither side starts first nor gets other prompts. A closed
    loop's throughput per stream is its output per request over its latency, so the ratio of the
    mean latencies is the ratio of the two sides' throughputs. Requests finishing after the list
    ran out do not count (the loop is draining then).

    Precise (both halves direct read 1.000) but biased against the gateway: the engine takes in a
    wave of new requests over several steps, first come first served, and a request through the
    gateway reaches it a millisecond after the direct ones sent at the same moment, so it starts
    at the back of each wave (docs/gateway-bench.md, 2026-11-24)."""
    targets = {"direct": direct_url, "gateway": gateway_url}
    settings = {
        name: RequestSettings(base_url=url, model=MODEL, ignore_eos=True) for name, url in targets.items()
    }
    queue = list(reversed(requests))
    counted: dict[str, list[RequestResult]] = {name: [] for name in targets}
    async with make_client(REQUEST_TIMEOUT_S) as client:

        async def worker(name: str) -> None:
            while queue:
                result = await send_request(client, settings[name], queue.pop())
                if queue and result.is_success:
                    counted[name].append(result)

        names = list(targets)
        await asyncio.gather(*(worker(names[(k + parity) % 2]) for k in range(concurrency)))

    def mean_ms(name: str, key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in counted[name]) * 1000

    def median_ms(name: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in counted[name]) * 1000

    return {
        "num_counted": float(min(len(v) for v in counted.values())),
        "throughput_ratio": mean_ms("direct", "e2el_s") / mean_ms("gateway", "e2el_s"),
        "added_median_e2el_ms": median_ms("gateway", "e2el_s") - median_ms("direct", "e2el_s"),
        "added_median_ttft_ms": median_ms("gateway", "ttft_s") - median_ms("direct", "ttft_s"),
    }


async def twin_round(
    direct: tuple[str, str], via_gateway: tuple[str, str], requests: list[BenchRequest], concurrency: int
) -> dict[str, float]:
    """Two closed loops at once, each with half the streams and half the requests: one to
    `direct` = (engine URL, model), one to `via_gateway` = (gateway URL, the other engine's model).
    A closed loop's throughput per stream is its output per request over its latency, so the ratio
    of the two sides' mean latencies is the ratio of their throughputs (counting completed requests
    would only resolve whole waves of them). Only requests that finished while both sides still had
    requests to send count, so neither gets the cores to itself at the end."""
    arms = {"direct": direct, "gateway": via_gateway}
    half, n = concurrency // 2, len(requests) // 2
    done: dict[str, list[tuple[float, RequestResult]]] = {name: [] for name in arms}
    ran_out: dict[str, float] = {}
    async with make_client(REQUEST_TIMEOUT_S) as client:

        async def arm(name: str, queue: list[BenchRequest]) -> None:
            url, model = arms[name]
            settings = RequestSettings(base_url=url, model=model, ignore_eos=True)

            async def worker() -> None:
                while queue:
                    result = await send_request(client, settings, queue.pop())
                    if result.is_success:
                        done[name].append((time.perf_counter(), result))
                    if not queue:
                        ran_out.setdefault(name, time.perf_counter())

            await asyncio.gather(*(worker() for _ in range(half)))

        await asyncio.gather(
            arm("direct", list(reversed(requests[:n]))), arm("gateway", list(reversed(requests[n:])))
        )
    cutoff = min(ran_out.values())
    counted = {name: [r for at, r in done[name] if at <= cutoff] for name in arms}
    if not all(counted.values()):
        raise ValueError("no request finished while both sides ran: give each side more requests")
    mean_e2el_s = {name: statistics.fmean(r.e2el_s for r in results) for name, results in counted.items()}
    return {
        "num_counted": float(min(len(results) for results in counted.values())),
        "direct_mean_e2el_ms": mean_e2el_s["direct"] * 1000,
        "gateway_mean_e2el_ms": mean_e2el_s["gateway"] * 1000,
        "throughput_ratio": mean_e2el_s["direct"] / mean_e2el_s["gateway"],
    }


def summarize_rounds(prefix: str, rounds: list[dict[str, float]]) -> dict[str, float]:
    """The median of the rounds' throughput ratios with its interquartile range and mean, and the
    median of any other per-round figure, each under `prefix`."""
    ratios = [r["throughput_ratio"] for r in rounds]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    summary = {
        f"{prefix}_throughput_ratio": statistics.median(ratios),
        f"{prefix}_throughput_ratio_q1": q1,
        f"{prefix}_throughput_ratio_q3": q3,
        f"{prefix}_throughput_ratio_mean": statistics.fmean(ratios),
    }
    for key in rounds[0]:
        if key.startswith("added_"):
            summary[f"{prefix}_{key}"] = statistics.median(r[key] for r in rounds)
    return summary


def probe_pairs_ms(targets: dict[str, str], num_pairs: int) -> dict[str, list[float]]:
    """One-at-a-time non-streaming requests for a single token, alternating between the targets
    (the order flips every pair): the per-request path cost, paired against the machine's drift."""
    body = {"model": MODEL, "prompt": "ping", "max_tokens": 1}
    out: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    with httpx.Client(timeout=30) as client:
        for i in range(num_pairs):
            for name in names if i % 2 == 0 else reversed(names):
                start = time.perf_counter()
                response = client.post(targets[name] + "/v1/completions", json=body)
                out[name].append((time.perf_counter() - start) * 1000)
                response.raise_for_status()
    return out


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = ensure_model(args.model_dir, args.preset)
    requests = stream_requests(args.num_requests, args.output_tokens)
    runs: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
    probes: dict[str, list[float]] = {"direct": [], "gateway": []}
    twins: dict[str, list[dict[str, float]]] = {}
    mixed: list[dict[str, float]] = []
    cores = place(args.layout)
    placed = (sorted(cores.engine), sorted(cores.gateway), sorted(cores.client))
    logger.info("cores: engine %s, gateway %s, client %s", *placed)
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-overhead-")))
        # Child processes inherit this process's CPU affinity when they start.
        engine = stack.enter_context(
            start_loop_engine(model_dir, work_dir, MODEL, args.concurrency, cores.engine)
        )
        os.sched_setaffinity(0, cores.gateway)
        extra = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.gateway_setting)}
        gateway = stack.enter_context(start_gateway({MODEL: [engine.url]}, work_dir, **extra))
        os.sched_setaffinity(0, cores.client)
        targets = {"direct": engine.url, "gateway": gateway.url}
        run_async(closed_loop(engine.url, requests[: args.concurrency], args.concurrency))  # warm-up
        for round_index in range(args.rounds):
            order = list(targets.items()) if round_index % 2 == 0 else list(reversed(targets.items()))
            for name, url in order:
                pids = {"engine": engine.proc.pid, "gateway": gateway.proc.pid}
                before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                client_before = time.process_time()
                results, duration_s = run_async(closed_loop(url, requests, args.concurrency))
                used = {k: cpu_seconds(pid) - before[k] for k, pid in pids.items()}
                used["client"] = time.process_time() - client_before
                runs[name].append(streams_summary(results, duration_s, used))
                logger.info("round %d %s: %s", round_index, name, runs[name][-1])
            for name, latencies in probe_pairs_ms(targets, args.num_probes // args.rounds).items():
                probes[name] += latencies
        for round_index in range(args.mixed_rounds):
            mixed_run = mixed_round(engine.url, gateway.url, requests, args.concurrency, round_index % 2)
            mixed.append(run_async(mixed_run))
            logger.info("mixed round %d: %s", round_index, mixed[-1])
        queue_wait_s = gateway.metric("corral_gateway_queue_wait_seconds_sum")
        if args.twin_rounds + args.twin_aa_rounds > 0:
            twins = run_twin_rounds(args, stack, model_dir, work_dir, cores, engine.url, requests, extra)
    summary = summarize(runs, probes) if args.rounds > 0 else {}
    if mixed:
        summary.update(summarize_rounds("mixed", mixed))
    for kind, rounds in twins.items():
        if rounds:
            summary.update(summarize_rounds(kind, rounds))
    summary["gateway_queue_wait_s"] = queue_wait_s
    summary["engine_cpus"] = len(cores.engine)
    summary["gateway_cpus"] = len(cores.gateway)
    summary["client_cpus"] = len(cores.client)
    summary["gateway_shares_the_engines_cores"] = float(bool(cores.gateway & cores.engine))
    summary["client_shares_the_engines_cores"] = float(bool(cores.client & cores.engine))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"runs": runs, "mixed_rounds": mixed, **twins, "summary": summary}
    (args.out / "overhead.json").write_text(json.dumps(report, indent=2))
    logger.info("results in %s\n%s", args.out, table(summary))
    return 0


def run_twin_rounds(
    args: argparse.Namespace,
    stack: ExitStack,
    model_dir: Path,
    work_dir: Path,
    cores: Placement,
    engine_url: str,
    requests: list[BenchRequest],
    gateway_settings: dict[str, Any],
) -> dict[str, list[dict[str, float]]]:
    """Start the twin engine and a gateway for both engines, then run the twin rounds (one half
    through the gateway) and the calibration rounds (both halves straight to their engine)."""
    twin = stack.enter_context(
        start_loop_engine(model_dir, work_dir, TWIN_MODEL, args.concurrency, cores.engine)
    )
    os.sched_setaffinity(0, cores.gateway)
    backends = {MODEL: [engine_url], TWIN_MODEL: [twin.url]}
    gateway = stack.enter_context(start_gateway(backends, work_dir, **gateway_settings))
    os.sched_setaffinity(0, cores.client)
    warm_up = requests[: 3 * args.concurrency]  # enough for both sides to finish some while both run
    run_async(twin_round((twin.url, TWIN_MODEL), (gateway.url, MODEL), warm_up, args.concurrency))
    engines = [(engine_url, MODEL), (twin.url, TWIN_MODEL)]
    rounds: dict[str, list[dict[str, float]]] = {"twin": [], "twin_aa": []}
    for round_index in range(args.twin_rounds):
        direct, behind = engines if round_index % 2 == 0 else engines[::-1]
        result = run_async(twin_round(direct, (gateway.url, behind[1]), requests, args.concurrency))
        rounds["twin"].append(result)
        logger.info("twin round %d (%s behind the gateway): %s", round_index, behind[1], result)
    for round_index in range(args.twin_aa_rounds):
        first, second = engines if round_index % 2 == 0 else engines[::-1]
        result = run_async(twin_round(first, second, requests, args.concurrency))
        rounds["twin_aa"].append(result)
        logger.info("twin A/A round %d (both straight): %s", round_index, result)
    return rounds


def summarize(runs: dict[str, list[dict[str, float]]], probes: dict[str, list[float]]) -> dict[str, Any]:
    def med(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    ratios = [
        g["output_tok_s"] / d["output_tok_s"] for d, g in zip(runs["direct"], runs["gateway"], strict=True)
    ]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3

    def added(key: str) -> float:
        return statistics.median(
            g[key] - d[key] for d, g in zip(runs["direct"], runs["gateway"], strict=True)
        )

    probe_diffs = [g - d for d, g in zip(probes["direct"], probes["gateway"], strict=True)]
    return {
        "direct_output_tok_s": med("direct", "output_tok_s"),
        "gateway_output_tok_s": med("gateway", "output_tok_s"),
        # The median over rounds of gateway / direct within the round, and its interquartile range.
        "throughput_ratio": statistics.median(ratios),
        "throughput_ratio_q1": q1,
        "throughput_ratio_q3": q3,
        "added_median_e2el_ms": added("median_e2el_ms"),
        "added_median_ttft_ms": added("median_ttft_ms"),
        "direct_probe_median_ms": statistics.median(probes["direct"]),
        "gateway_probe_median_ms": statistics.median(probes["gateway"]),
        "added_probe_median_ms": statistics.median(probe_diffs),
        "gateway_cores_while_proxying": med("gateway", "gateway_cores"),
        "gateway_cpu_us_per_token": med("gateway", "gateway_cpu_us_per_token"),
        "engine_cores_direct": med("direct", "engine_cores"),
        "engine_cores_via_gateway": med("gateway", "engine_cores"),
        "client_cores_direct": med("direct", "client_cores"),
        "client_cores_via_gateway": med("gateway", "client_cores"),
    }


def table(summary: dict[str, Any]) -> str:
    rows = [f"| {key} | {value:.3f} |" for key, value in summary.items()]
    return "\n".join(["| measure | value |", "|---|---:|", *rows])


if __name__ == "__main__":
    raise SystemExit(main())
