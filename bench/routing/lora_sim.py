"""LoRA affinity at fleet scale: simulated replicas serving many adapters behind the gateway's
router, the same requests routed with LoRA affinity and without it.

    .venv/bin/python -m bench.routing.lora_sim --replicas 16 64 --out bench/results/lora-sim

Each replica lists every adapter and runs at most `--max-loras` of them at once (vLLM-like 4);
copying an adapter into a slot and its products cost step time (`corral_engine.sim.lora_cost`).
Requests are a `fleet_sim` workload's, each naming one of `--num-adapters` adapters by a
Zipf(`--zipf`) popularity or, for `--base-share` of them, the base model. Load is a share of the
fleet's capacity for the same requests without adapters (`fleet_sim.measure_capacity`). Writes
lora_sim.json, lora_sim.md and lora_sim.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from corral_engine.sim.lora_cost import lora_cost
from corral_engine.sim.perf_model import BUILTIN, load_profile

from bench.routing.des import FleetLora, FleetSim, GatewayModel, Outcome
from bench.routing.fleet_sim import POLICIES, fleet_profiles, measure_capacity, summarize
from bench.routing.sim_workloads import WORKLOADS, AdapterMix, WorkloadSpec, build, with_adapters

logger = logging.getLogger("lora_sim")
ARMS = {"affinity": True, "no-affinity": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="h100-llama3-8b", help=f"one of {', '.join(BUILTIN)} or a JSON file")
    p.add_argument("--replicas", type=int, nargs="+", default=[16])
    p.add_argument("--workload", default="sharegpt", choices=WORKLOADS)
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.85], help="x the base model's capacity")
    p.add_argument("--policies", nargs="+", default=["prefix-affinity"], choices=POLICIES)
    p.add_argument("--num-requests", type=int, default=4000, help="per run, per 16 replicas")
    p.add_argument("--num-adapters", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.0, help="adapter popularity: weight 1 / rank^zipf")
    p.add_argument("--base-share", type=float, default=0.2, help="share of requests for the base model")
    p.add_argument("--max-loras", type=int, default=4, help="adapters a replica runs at once")
    p.add_argument("--lora-rank", type=int, default=16, help="of every adapter, on all 7 projections")
    p.add_argument("--poll-interval-s", type=float, default=0.075, help="load and adapter polls")
    p.add_argument("--heterogeneous", action="store_true", help="every other replica has half the KV cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/lora-sim"))
    p.add_argument("--from-json", type=Path, nargs="+", help="only merge these runs' table and plot")
    return p.parse_args(argv)


def lora_figures(outcomes: dict[str, Outcome], sim: FleetSim, span_s: float) -> dict[str, Any]:
    """Slot loads, the tiers adapter requests were routed to, and TTFT by kind of request."""
    done = [o for o in outcomes.values() if o.is_counted and o.first_token_s is not None]
    out: dict[str, Any] = {}
    for kind, mine in (
        ("adapter", [o for o in done if o.adapter]),
        ("base", [o for o in done if not o.adapter]),
    ):
        ttft = np.array([o.first_token_s - o.arrival_s for o in mine])  # type: ignore[operator]
        out[f"{kind}_ttft_p50_ms"] = 1000 * float(np.percentile(ttft, 50)) if len(ttft) else None
        out[f"{kind}_ttft_p99_ms"] = 1000 * float(np.percentile(ttft, 99)) if len(ttft) else None
    num_loads = sum(e.num_lora_loads_total for e in sim.engines)
    num_routed = sum(sim.affinity_counts.values())
    served = [{o.adapter for o in done if o.replica == i and o.adapter} for i in range(len(sim.engines))]
    out["num_slot_loads"] = num_loads
    out["slot_loads_s"] = num_loads / span_s
    out["slot_loads_per_request"] = num_loads / max(1, len(outcomes))  # warm-up and all
    out["affinity_shares"] = (
        {t.label: k / num_routed for t, k in sim.affinity_counts.items()} if num_routed else {}
    )
    out["num_adapters_served_mean"] = float(np.mean([len(s) for s in served]))  # distinct, per replica
    return out


def run_cell(args: argparse.Namespace, n: int, capacity: float, load: float) -> dict[str, Any]:
    """Every policy, with LoRA affinity and without, on the same requests."""
    rate = load * capacity
    num_requests = args.num_requests * max(1, n // 16)
    mix = AdapterMix(args.num_adapters, args.zipf, args.base_share, args.seed)
    requests = with_adapters(
        build(WorkloadSpec(args.workload, num_requests, rate, 1.0, n, seed=args.seed)), mix
    )
    profiles = fleet_profiles(args, n)
    cost = lora_cost(profiles[0], rank=args.lora_rank)
    cell: dict[str, Any] = {"replicas": n, "workload": args.workload, "load": load, "rate_req_s": rate}
    cell |= {"capacity_req_s": capacity, "adapter_load_ms": 1000 * cost.load_s, "runs": {}}
    for policy in args.policies:
        for arm, is_affinity in ARMS.items():
            started = time.perf_counter()
            lora = FleetLora(tuple(mix.names()), args.max_loras, cost, is_affinity)
            sim = FleetSim(
                profiles, GatewayModel(policy, poll_interval_s=args.poll_interval_s), args.seed, lora=lora
            )
            outcomes = sim.run(requests)
            row = summarize(outcomes, sim)
            row |= lora_figures(outcomes, sim, row["span_s"])
            cell["runs"][f"{policy}/{arm}"] = row
            logger.info(
                "%3d replicas load %.2f %-28s TTFT p50 %6.0f p99 %7.0f ms (adapter p99 %7.0f, "
                "base p99 %7.0f), %6.1f req/s, %5.1f slot loads/s, active tier %.0f%% (%.0f s)",
                n, load, f"{policy}/{arm}", row["ttft_p50_ms"], row["ttft_p99_ms"],
                row["adapter_ttft_p99_ms"] or 0.0, row["base_ttft_p99_ms"] or 0.0, row["req_s"],
                row["slot_loads_s"], 100 * row["affinity_shares"].get("active", 0.0),
                time.perf_counter() - started,
            )  # fmt: skip
    return cell


def table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| replicas | load | policy / LoRA affinity | TTFT p50 (ms) | TTFT p99 (ms) | adapter p99 (ms) "
        "| base p99 (ms) | TPOT p50 (ms) | req/s | output tok/s | in SLO | slot loads/s | loads a request "
        "| routed active "
        "| adapters a replica |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        for name, r in c["runs"].items():
            base = "-" if r["base_ttft_p99_ms"] is None else f"{r['base_ttft_p99_ms']:.0f}"
            active = r["affinity_shares"].get("active")
            lines.append(
                f"| {c['replicas']} | {c['load']:.2f} | {name} | {r['ttft_p50_ms']:.0f} | "
                f"{r['ttft_p99_ms']:.0f} | "
                f"{r['adapter_ttft_p99_ms']:.0f} | {base} | {r['tpot_p50_ms']:.1f} | {r['req_s']:.1f} | "
                f"{r['output_tok_s']:.0f} | {100 * r['slo_share']:.1f}% | {r['slot_loads_s']:.1f} | "
                f"{r['slot_loads_per_request']:.3f} | "
                f"{'-' if active is None else f'{100 * active:.0f}%'} | {r['num_adapters_served_mean']:.1f} |"
            )
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    """One bar group per (replicas, load, policy): each metric with affinity and without."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (
        ("ttft_p50_ms", "TTFT p50 (ms)", True),
        ("ttft_p99_ms", "TTFT p99 (ms)", True),
        ("req_s", "throughput (req/s)", False),
        ("slot_loads_s", "adapter slot loads / s", False),
        ("slot_loads_per_request", "adapter slot loads / request", False),
        ("slo_share", "share in SLO", False),
    )
    groups = [(c, p) for c in cells for p in dict.fromkeys(k.split("/")[0] for k in c["runs"])]
    policies = {p for _, p in groups}
    labels = [
        f"{c['replicas']}\n{c['load']:.2f}" + (f"\n{p}" if len(policies) > 1 else "") for c, p in groups
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    x = np.arange(len(groups))
    for ax, (key, title, log) in zip(axes.flat, metrics, strict=True):
        for k, arm in enumerate(ARMS):
            values = [c["runs"][f"{p}/{arm}"][key] for c, p in groups]
            ax.bar(x + (k - 0.5) * 0.4, values, 0.4, label=f"LoRA {arm}", color=f"C{k}")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlabel("replicas / load (x base-model capacity)", fontsize=8)
        ax.set_title(f"{title}, {' / '.join(sorted(policies))}" if key == "ttft_p50_ms" else title)
        if log:
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(cells: list[dict[str, Any]], head: dict[str, Any], out: Path) -> None:
    """lora_sim.md, lora_sim.json (`head` and the cells) and lora_sim.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    text = table(cells)
    (out / "lora_sim.md").write_text(text + "\n")
    (out / "lora_sim.json").write_text(json.dumps(head | {"cells": cells}, indent=1))
    plot(cells, out / "lora_sim.png")
    logger.info("\n%s", text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.from_json:  # each run's cells, by fleet size and load
        runs = [json.loads(path.read_text()) for path in args.from_json]
        cells = sorted((c for run in runs for c in run["cells"]), key=lambda c: (c["replicas"], c["load"]))
        write(
            cells, {"sources": [str(p) for p in args.from_json], "runs": [r["args"] for r in runs]}, args.out
        )
        return 0
    load_profile(args.profile)  # an unknown profile fails before any run
    cells = []
    for n in args.replicas:
        capacity = measure_capacity(args, n, args.workload)
        logger.info("%d replicas, %s without adapters: capacity %.1f req/s", n, args.workload, capacity)
        cells += [run_cell(args, n, capacity, load) for load in args.loads]
    plain = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write(cells, {"args": plain}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
