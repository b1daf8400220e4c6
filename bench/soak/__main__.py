"""Soak: a simulated fleet (`corral engine --simulate`: the real scheduler, block manager and
server, fixed step times), or with `--engine model` one engine running the tiny demo model (the
model runner, sampler and kernels too, and a KV cache small enough to evict and preempt), and a
gateway in front, under steady mixed traffic for `--minutes`: streamed and whole chat and text
completions, `n=2`, sampled requests with stop strings and log probabilities, prompts sharing a
preamble, clients that drop their stream after two chunks, invalid requests (400) and unknown
models (404) (`traffic.py`). Every
`--sample-s` it reads both processes' resident memory, open file descriptors, threads and CPU from
/proc and their collector passes from /metrics. After the traffic it waits for the engines to go
idle and reads their KV usage and queues (every block a dropped stream held must be free again).

    .venv/bin/python -m bench.soak --minutes 30 --rate 20 --out bench/results/soak
    .venv/bin/python -m bench.soak --engine model --minutes 30 --rate 5 --out bench/results/soak-model

Prints the per-process table and the requests by kind and outcome; writes soak.json and soak.png
to --out. A leak shows as a trend (MiB an hour, least squares over the samples after the warm-up)
that does not flatten, and as full collector passes that take longer in the second half."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
from corral_cli import malloc
from corral_engine import wire
from corral_gateway.metrics import GC_PAUSE_SECONDS as GATEWAY_GC
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench.routing.fleet import MODEL, cpu_seconds, ensure_model, start_gateway
from bench.routing.overhead_sim import replica_urls, sim_profile, start_sim_fleet
from bench.routing.overhead_sim_report import collector_totals
from bench.soak import report, traffic
from e2e.procs import ManagedProcess, start_engine

logger = logging.getLogger("soak")
_KV_BLOCKS = 4096  # per simulated replica: room for every request in flight at the default rate
# An engine's /metrics sample -> its figure in a soak sample (summed over an engine's replicas).
_ENGINE_FIGURES = {
    wire.NUM_REQUESTS_RUNNING: "running",
    wire.NUM_REQUESTS_WAITING: "waiting",
    wire.KV_CACHE_USAGE_PERC: "kv_usage",
    wire.PREFIX_CACHE_HITS_TOTAL: "prefix_hit_tokens",
    wire.NUM_PREEMPTIONS_TOTAL: "preemptions",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the traffic runs")
    p.add_argument("--rate", type=float, default=20.0, help="requests a second (Poisson)")
    p.add_argument("--engine", choices=("simulated", "model"), default="simulated",
                   help="simulated replicas, or one engine running the tiny demo model")  # fmt: skip
    p.add_argument("--replicas", type=int, default=2, help="simulated replicas (one process)")
    p.add_argument("--step-ms", type=float, default=20.0, help="every simulated step's time")
    p.add_argument("--kv-blocks", type=int, default=256,
                   help="the model engine's KV blocks (16 tokens each): the default fills at ~12 "
                   "requests in flight, so the prefix cache evicts and long queues preempt")  # fmt: skip
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="share of the run before the trend")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--idle-timeout-s", type=float, default=120.0, help="wait for the engines to go idle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "corral" / "demo-model")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    return p.parse_args(argv)


def proc_figures(pid: int) -> dict[str, float]:
    """Resident memory (MiB), open file descriptors, threads and CPU seconds of a process, from /proc."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": float(fields["Threads"]),
        "fds": float(len(os.listdir(f"/proc/{pid}/fd"))),
        "cpu_s": cpu_seconds(pid),
    }


def metric_figures(text: str, gc_name: str) -> dict[str, float]:
    """From one /metrics page: the collector's passes (cumulative; `collector_totals`), and an
    engine's running and waiting requests, KV usage, and its prefix-cache hits and preemptions so
    far (which say the traffic reached those paths); none of the engine's on a gateway."""
    out = collector_totals(text, gc_name)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _ENGINE_FIGURES:
                key = _ENGINE_FIGURES[s.name]
                out[key] = out.get(key, 0.0) + s.value
    return out


async def _metrics(session: aiohttp.ClientSession, url: str, gc_name: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        return metric_figures(await resp.text(), gc_name)


async def sample(
    session: aiohttp.ClientSession, pids: dict[str, int], urls: dict[str, list[str]], t_s: float
) -> dict[str, dict[str, float]]:
    """One sample of every process; an engine process's gauges summed over its replicas (its
    collector is the process's, so read once)."""
    out = {}
    for name, pid in pids.items():
        gc_name = GATEWAY_GC if name == "gateway" else wire.GC_PAUSE_SECONDS
        pages = [await _metrics(session, url, gc_name) for url in urls[name]]
        figures = {"t_s": t_s, **proc_figures(pid), **pages[0]}
        for key in _ENGINE_FIGURES.values():
            if key in pages[0]:
                figures[key] = sum(p[key] for p in pages)
        out[name] = figures
    return out


async def soak(
    args: argparse.Namespace, gateway_url: str, pids: dict[str, int], urls: dict[str, list[str]]
) -> dict[str, Any]:
    duration_s = 60.0 * args.minutes
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in pids}
    results: list[tuple[str, str]] = []
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def sampler() -> None:
            while True:
                for name, figures in (await sample(session, pids, urls, time.monotonic() - start)).items():
                    samples[name].append(figures)
                await asyncio.sleep(args.sample_s)

        with Progress(
            TextColumn("soak"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
            TextColumn("{task.fields[requests]} requests"), TimeElapsedColumn(), disable=args.no_progress,
        ) as progress:  # fmt: skip
            bar = progress.add_task("soak", total=duration_s, requests=0)

            def on_result(kind: str, outcome: str) -> None:
                results.append((kind, outcome))
                elapsed_s = min(duration_s, time.monotonic() - start)
                progress.update(bar, completed=elapsed_s, requests=len(results))

            sampling = asyncio.create_task(sampler())
            sent = await traffic.run(
                gateway_url, MODEL, args.rate, duration_s, args.seed, on_result,
                exact_logprobs=args.engine == "model",
            )  # fmt: skip
            sampling.cancel()
        idle_after_s = await wait_idle(session, urls["engine"], args.idle_timeout_s)
        final = await sample(session, pids, urls, time.monotonic() - start)
    return {
        "sent": sent, "results": results, "samples": samples, "final": final, "idle_after_s": idle_after_s,
    }  # fmt: skip


async def wait_idle(session: aiohttp.ClientSession, urls: list[str], timeout_s: float) -> float | None:
    """Seconds until every replica has nothing running or waiting and no KV block in use; None if not."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        pages = [await _metrics(session, url, wire.GC_PAUSE_SECONDS) for url in urls]
        if all(p["running"] == p["waiting"] == p["kv_usage"] == 0 for p in pages):
            return time.monotonic() - start
        await asyncio.sleep(0.5)
    return None


def start_engines(
    args: argparse.Namespace, model_dir: Path, work_dir: Path
) -> tuple[ManagedProcess, list[str]]:
    """The engine process and its replicas' addresses: simulated replicas, or the model."""
    if args.engine == "model":
        # As `corral up` and the engine image start it: tcmalloc where installed (CORRAL_TCMALLOC=0: not).
        engine = start_engine(
            model_dir, log_dir=work_dir, env=malloc.engine_env(os.environ), served_model_name=MODEL,
            num_kv_blocks=args.kv_blocks, max_num_seqs=64, log_level="warning",
        )  # fmt: skip
        logger.info("soak: %.1f min at %.1f requests/s, one engine on the tiny model, %d KV blocks",
                    args.minutes, args.rate, args.kv_blocks)  # fmt: skip
        return engine, [engine.url]
    profile = work_dir / "profile.json"
    profile.write_text(json.dumps(sim_profile(args.step_ms / 1000, 256, _KV_BLOCKS)))
    fleet = start_sim_fleet(model_dir, work_dir, profile, args.replicas)
    logger.info("soak: %.1f min at %.1f requests/s, %d simulated replicas, step %.0f ms",
                args.minutes, args.rate, args.replicas, args.step_ms)  # fmt: skip
    return fleet, replica_urls(fleet, args.replicas)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = ensure_model(args.model_dir, "tiny")
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-soak-")))
        engines, engine_urls = start_engines(args, model_dir, work_dir)
        stack.enter_context(engines)
        gateway = stack.enter_context(start_gateway({MODEL: engine_urls}, work_dir))
        pids = {"engine": engines.proc.pid, "gateway": gateway.proc.pid}
        urls = {"engine": engine_urls, "gateway": [gateway.url]}
        run = asyncio.run(soak(args, gateway.url, pids, urls))
        run["allocator"] = "tcmalloc" if malloc.is_loaded(Path(f"/proc/{engines.proc.pid}/maps")) else "glibc"
    warmup_s = args.warmup_fraction * 60.0 * args.minutes
    processes = {name: report.process_summary(run["samples"][name], warmup_s) for name in pids}
    doc = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "engine_allocator": run["allocator"],
        "sent": run["sent"],
        "outcomes": report.outcomes(run["results"]),
        "idle_after_s": run["idle_after_s"],
        "final": run["final"],
        "processes": processes,
        "samples": run["samples"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(doc, indent=2))
    report.plot(run["samples"], warmup_s, args.out / "soak.png")
    final = run["final"]["engine"]
    logger.info(
        "results in %s\n%s\nrequests by kind and outcome: %s\nidle after %s s; then running %d, waiting "
        "%d, KV usage %.3f; prompt tokens from the prefix cache %d, preemptions %d", args.out,
        report.table(processes), doc["outcomes"], run["idle_after_s"], final["running"], final["waiting"],
        final["kv_usage"], final["prefix_hit_tokens"], final["preemptions"],
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
