"""Routing at fleet scale (issue 25): simulated GPU replicas (16 and 64) behind the gateway's own
router and policies, on a virtual clock, for every workload, load and arrival process.

    .venv/bin/python -m bench.routing.fleet_sim --replicas 16 64 --out bench/results/fleet-sim

Each (fleet size, workload) first measures the fleet's capacity: the workload's requests all at
once through round-robin, completions per second between the 10th and 90th percentile finish.
Every run then offers `load` x that capacity, Poisson (and bursty, gamma shape 0.25, at
`--bursty-loads`), and every policy sees the same requests at the same times. Reports p50/p99
TTFT and TPOT, goodput under the SLO (TTFT < 1 s and TPOT < 50 ms), throughput, prefix-cache hit
rate and preemptions; writes fleet_sim.json, fleet_sim.md and one PNG per fleet size.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from corral_engine.outputs import EngineStats
from corral_engine.sim.perf_model import BUILTIN, describe, load_profile
from corral_gateway.policies import QUEUED_BLOCK_WEIGHT, STEP_WAIT_BLOCKS_PER_S

from bench.routing.des import FleetSim, GatewayModel, Outcome
from bench.routing.fleet_sim_report import plot, summary, table
from bench.routing.sim_workloads import WORKLOADS, SimRequest, WorkloadSpec, build
from bench.routing.ttft_breakdown import breakdown, format_breakdown
from bench.routing.ttft_floor import Floor, ttft_floors

logger = logging.getLogger("fleet_sim")
POLICIES = ("round-robin", "least-requests", "kv-aware", "prefix-affinity", "llm-d")
TTFT_SLO_S, TPOT_SLO_S = 1.0, 0.050
BURSTY_SHAPE = 0.25


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="h100-llama3-8b", help=f"one of {', '.join(BUILTIN)} or a JSON file")
    p.add_argument("--replicas", type=int, nargs="+", default=[16, 64])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.85, 1.1], help="x fleet capacity")
    p.add_argument("--bursty-loads", type=float, nargs="*", default=[0.85], help="loads also run bursty")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--duration-s", type=float, default=60.0, help="virtual seconds of arrivals per run")
    p.add_argument("--min-requests", type=int, default=2000)
    p.add_argument("--max-requests", type=int, default=4000, help="per run, per 16 replicas")
    p.add_argument(
        "--warmup-s", type=float, default=0.0, help="chat: seconds of turns sent before the counted window"
    )
    p.add_argument("--heterogeneous", action="store_true", help="every other replica has half the KV cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--breakdown", action="store_true", help="split each request's TTFT into where it went (more CPU)"
    )
    p.add_argument("--poll-interval-s", type=float, default=0.075, help="load polls of each replica")
    p.add_argument(
        "--step-blocks-per-s",
        type=float,
        default=STEP_WAIT_BLOCKS_PER_S,
        help="prefix affinity's price of a replica's step in flight, in blocks a second (0: off)",
    )
    p.add_argument(
        "--queued-block-weight",
        type=float,
        default=QUEUED_BLOCK_WEIGHT,
        help="prefix affinity's weight of a prompt's own blocks per request sent to a replica since "
        "its step in flight began (0: off)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/fleet-sim"))
    p.add_argument("--from-json", type=Path, nargs="+", help="only redo the table and plots of these runs")
    return p.parse_args()


def merge_cells(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells of several runs' fleet_sim.json, one per (profile, replicas, workload, load,
    arrivals); a later run's policies override an earlier one's in the same cell. A run keeps its
    profile in its arguments, a merged file in each cell (None where neither says)."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for run in runs:
        run_profile = run.get("args", {}).get("profile")
        for c in run["cells"]:
            c.setdefault("profile", run_profile)
            key = (c["profile"], c["replicas"], c["workload"], c["load"], c["arrivals"])
            if key in merged:
                merged[key]["policies"] |= c["policies"]
            else:
                merged[key] = c
    order = ["round-robin", "least-requests", "kv-aware", "prefix-affinity", "llm-d"]
    cells = sorted(
        merged.values(),
        key=lambda c: (c["profile"] or "", c["replicas"], c["workload"], c["arrivals"], c["load"]),
    )
    for cell in cells:
        cell["policies"] = {p: cell["policies"][p] for p in order if p in cell["policies"]}
    return cells


def rerender(paths: list[Path], out: Path) -> int:
    """Merge earlier runs' fleet_sim.json into one table and plots (goodput as requests in SLO per
    second of arrivals, also for runs that wrote it per second of the whole run)."""
    cells = merge_cells([json.loads(path.read_text()) for path in paths])
    for cell in cells:
        for row in cell["policies"].values():
            row["goodput_req_s"] = (
                row["offered_req_s"] * row["slo_share"] * row["num_done"] / row["num_requests"]
            )
    out.mkdir(parents=True, exist_ok=True)
    profiles = sorted({c["profile"] or "" for c in cells})
    for profile in profiles:
        mine = [c for c in cells if (c["profile"] or "") == profile]
        suffix = f"_{Path(profile).stem or 'unknown'}" if len(profiles) > 1 else ""
        for n in sorted({c["replicas"] for c in mine}):
            plot([c for c in mine if c["replicas"] == n], out / f"fleet_sim_{n}{suffix}.png")
    text = summary(cells) + "\n\n" + table(cells)
    (out / "fleet_sim.md").write_text(text + "\n")
    (out / "fleet_sim.json").write_text(
        json.dumps({"sources": [str(p) for p in paths], "cells": cells}, indent=1)
    )
    logger.info("%s", text)
    return 0


def fleet_profiles(args: argparse.Namespace, num_replicas: int) -> list[Any]:
    profile = load_profile(args.profile)
    if not args.heterogeneous:
        return [profile] * num_replicas
    half = replace(profile, num_kv_blocks=profile.num_kv_blocks // 2)
    return [profile if i % 2 == 0 else half for i in range(num_replicas)]


def measure_capacity(args: argparse.Namespace, num_replicas: int, workload: str) -> float:
    """Requests per second round-robin completes with the fleet kept full, as `num_replicas` x one
    replica's (round-robin hands each replica an even random share of the same traffic, so one
    replica sees what each of them sees): a closed loop of 1.5 x max_num_seqs requests, each finish
    sending the next (the workload's request shapes, other words), counted between the first and
    last `concurrency` finishes. Heterogeneous fleets: the mean over the distinct profiles."""
    profiles = fleet_profiles(args, num_replicas)
    distinct = list({id(p): p for p in profiles}.values())
    per_replica = [_replica_capacity(args, p, num_replicas, workload) for p in distinct]
    return num_replicas * sum(per_replica) / len(per_replica)


def _replica_capacity(args: argparse.Namespace, profile: Any, num_replicas: int, workload: str) -> float:
    concurrency = max(8, int(1.5 * profile.max_num_seqs))
    total = 6 * concurrency
    spec = WorkloadSpec(workload, total, float("inf"), 1.0, num_replicas, seed=args.seed + 7)
    requests = build(spec)
    backlog = requests[concurrency:][::-1]
    sim = FleetSim([profile], GatewayModel("round-robin"), args.seed)

    def next_request(_: Outcome) -> None:
        if backlog:
            sim.submit(backlog.pop())

    sim.on_finish = next_request
    finishes = sorted(o.finish_s for o in sim.run(requests[:concurrency]).values() if o.finish_s is not None)
    lo, hi = concurrency, len(finishes) - concurrency
    return (hi - lo) / max(1e-9, finishes[hi] - finishes[lo])


def _is_in_slo(o: Outcome) -> bool:
    if o.first_token_s is None or o.finish_s is None:
        return False
    is_tpot_ok = o.output_len <= 1 or (o.finish_s - o.first_token_s) / (o.output_len - 1) < TPOT_SLO_S
    return o.first_token_s - o.arrival_s < TTFT_SLO_S and is_tpot_ok


def summarize(outcomes: dict[str, Outcome], sim: FleetSim) -> dict[str, Any]:
    """The counted requests' figures (a warm-up's are left out, its engine counters too)."""
    counted = [o for o in outcomes.values() if o.is_counted]
    done = [o for o in counted if o.finish_s is not None and o.first_token_s is not None]
    ttft = np.array([o.first_token_s - o.arrival_s for o in done])  # type: ignore[operator]
    tpot = np.array([(o.finish_s - o.first_token_s) / (o.output_len - 1) for o in done if o.output_len > 1])  # type: ignore[operator]
    span_s = max(o.finish_s for o in done) - min(o.arrival_s for o in done)  # type: ignore[type-var,operator]
    good = sum(_is_in_slo(o) for o in done)
    stats = [e.stats() for e in sim.engines]
    before = sim.stats_at_mark or [EngineStats() for _ in sim.engines]
    hits = sum(
        s.num_prefix_cache_hits_total - b.num_prefix_cache_hits_total
        for s, b in zip(stats, before, strict=True)
    )
    queries = sum(
        s.num_prefix_cache_queries_total - b.num_prefix_cache_queries_total
        for s, b in zip(stats, before, strict=True)
    )
    arrivals = [o.arrival_s for o in counted]
    offered_req_s = len(counted) / max(1e-9, max(arrivals) - min(arrivals))
    return {
        "num_requests": len(counted),
        "num_warmup_requests": len(outcomes) - len(counted),
        "num_done": len(done),
        "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1000 * float(np.percentile(ttft, 99)),
        "tpot_p50_ms": 1000 * float(np.percentile(tpot, 50)),
        "tpot_p99_ms": 1000 * float(np.percentile(tpot, 99)),
        # Requests in SLO per second of arrivals: a run is a fixed set of requests, and the time
        # its longest replies take to drain after the last arrival says nothing about routing.
        "goodput_req_s": offered_req_s * good / len(counted),
        "slo_share": good / len(done),
        "req_s": len(done) / span_s,
        "output_tok_s": sum(o.output_len for o in done) / span_s,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "preemptions": sum(
            s.num_preemptions_total - b.num_preemptions_total for s, b in zip(stats, before, strict=True)
        ),
        "max_gateway_queue": sim.max_queue_len,
        "span_s": span_s,
        "offered_req_s": offered_req_s,
    }


def floor_figures(requests: list[SimRequest], floors: dict[str, Floor]) -> dict[str, float]:
    """p50/p99 of the counted requests' TTFT floors (`ttft_floor`), warm and cold."""
    mine = [floors[r.request_id] for r in requests if r.is_counted]
    warm = np.array([f.warm_s for f in mine])
    cold = np.array([f.cold_s for f in mine])
    return {
        "ttft_p50_ms": 1000 * float(np.percentile(warm, 50)),
        "ttft_p99_ms": 1000 * float(np.percentile(warm, 99)),
        "cold_ttft_p50_ms": 1000 * float(np.percentile(cold, 50)),
        "cold_ttft_p99_ms": 1000 * float(np.percentile(cold, 99)),
        "cached_share": sum(f.num_cached_tokens for f in mine)
        / sum(len(r.prompt) for r in requests if r.is_counted),
    }


def run_cell(
    args: argparse.Namespace, n: int, workload: str, capacity: float, load: float, shape: float
) -> dict[str, Any]:
    rate = load * capacity
    cap = args.max_requests * max(1, n // 16)
    num_requests = min(cap, max(args.min_requests, int(rate * args.duration_s)))
    warmup_s = args.warmup_s if workload == "chat" else 0.0
    requests = build(WorkloadSpec(workload, num_requests, rate, shape, n, seed=args.seed, warmup_s=warmup_s))
    arrivals = "poisson" if shape == 1.0 else "bursty"
    cell: dict[str, Any] = {"profile": args.profile, "replicas": n, "workload": workload, "load": load}
    cell["arrivals"] = arrivals
    cell |= {"rate_req_s": rate, "capacity_req_s": capacity, "warmup_s": warmup_s}
    floors = ttft_floors(requests, fleet_profiles(args, n)[0])
    cell |= {"floor": floor_figures(requests, floors), "policies": {}}
    logger.info(
        "%3d replicas %-8s load %.2f %-7s TTFT floor p50 %.0f p99 %.0f ms (cold %.0f / %.0f), "
        "%d requests + %d warm-up",
        n, workload, load, arrivals, cell["floor"]["ttft_p50_ms"], cell["floor"]["ttft_p99_ms"],
        cell["floor"]["cold_ttft_p50_ms"], cell["floor"]["cold_ttft_p99_ms"],
        sum(r.is_counted for r in requests), sum(not r.is_counted for r in requests),
    )  # fmt: skip
    for policy in args.policies:
        started = time.perf_counter()
        gateway = GatewayModel(
            policy,
            poll_interval_s=args.poll_interval_s,
            step_blocks_per_s=args.step_blocks_per_s,
            queued_block_weight=args.queued_block_weight,
        )
        sim = FleetSim(fleet_profiles(args, n), gateway, args.seed, trace=args.breakdown)
        outcomes = sim.run(requests, mark_s=warmup_s if warmup_s else None)
        row = summarize(outcomes, sim)
        cell["policies"][policy] = row
        if sim.tracer is not None:
            row["breakdown"] = breakdown(outcomes, sim.tracer.traces, floors)
            logger.info("%s TTFT breakdown, mean ms:\n%s", policy, format_breakdown(row["breakdown"]))
        logger.info(
            "%3d replicas %-8s load %.2f %-7s %-15s TTFT p50 %6.0f p99 %7.0f ms, "
            "TPOT p50 %4.1f p99 %5.1f ms, goodput %6.1f req/s (%.0f%%), hits %.2f, preemptions %d (%.0f s)",
            n, workload, load, arrivals, policy, row["ttft_p50_ms"], row["ttft_p99_ms"], row["tpot_p50_ms"],
            row["tpot_p99_ms"], row["goodput_req_s"], 100 * row["slo_share"], row["prefix_hit_rate"],
            row["preemptions"], time.perf_counter() - started,
        )  # fmt: skip
    return cell


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.from_json:
        return rerender(args.from_json, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    cells: list[dict[str, Any]] = []
    for n in args.replicas:
        for workload in args.workloads:
            capacity = measure_capacity(args, n, workload)
            logger.info("%d replicas, %s: capacity %.1f req/s", n, workload, capacity)
            runs = [(load, 1.0) for load in args.loads] + [(load, BURSTY_SHAPE) for load in args.bursty_loads]
            for load, shape in runs:
                cells.append(run_cell(args, n, workload, capacity, load, shape))
        plot([c for c in cells if c["replicas"] == n], args.out / f"fleet_sim_{n}.png")
    text = summary(cells) + "\n\n" + table(cells)
    report = {
        "args": vars(args) | {"out": str(args.out)},
        "profile": describe(load_profile(args.profile)),
        "slo": {"ttft_s": TTFT_SLO_S, "tpot_s": TPOT_SLO_S},
        "cells": cells,
    }
    (args.out / "fleet_sim.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "fleet_sim.md").write_text(text + "\n")
    logger.info("results in %s\n%s", args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
