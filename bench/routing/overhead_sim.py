"""Gateway overhead under concurrency against simulated replicas (issue 25): C concurrent streams
straight to a fleet of simulated replicas and through the gateway, in paired rounds (direct first in
even rounds, the gateway first in odd ones), at several concurrency levels (100 and 1,000 streams).

The replicas are `corral engine --simulate` in one process (no model, no torch), so the engine is not
what limits a 2-core machine; what one Python process can serve is. Their profile is a fixed step
time whatever the batch (a GPU decoding a memory-bound batch: a step reads the weights once), chosen
per level so that the whole fleet emits `--fleet-tok-s` tokens a second: step = streams / rate. At
that rate the replicas' process, the gateway and the load client together use well under the two
cores. A fixed step also keeps routing out of the comparison: a replica's tokens per second grow
with its batch, so the fleet's throughput is the same however the streams are spread.

Direct, the client spreads its requests over the replicas in turn; through the gateway, the gateway
routes them (its default policy unless `--gateway-setting policy=...`). Prompts share a prefix (a
system prompt every replica soon holds) and then differ, so the prefix index and the block-hash
chain do their usual work. Per round: added median and p99 TTFT and E2E (gateway minus direct),
throughput gateway / direct, errors, and CPU seconds from /proc for the gateway, the replicas'
process and the client; the gateway's CPU per request also less its idle use (load polls). Beside
those client-side figures, the gateway's own: its corral_gateway_overhead_seconds histogram's change
over each arm (from its /metrics), pooled over the rounds, as a median (bucket-interpolated) and a
mean per part.

    .venv/bin/python -m bench.routing.overhead_sim --concurrency 100 1000 --replicas 16 64 --rounds 8 3

Prints a Markdown table and writes `overhead_sim.json` and `overhead_sim.png` to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import yaml
from corral_cli.bench.client import RequestSettings, send_request
from corral_cli.bench.runner import make_client, run_async
from corral_cli.bench.stats import RequestResult
from corral_cli.bench.workload import BenchRequest
from corral_engine import wire
from prometheus_client.parser import text_string_to_metric_families

from bench.routing import overhead_sim_report as report
from bench.routing.fleet import MODEL, REQUEST_TIMEOUT_S, cpu_seconds, ensure_model, env_pairs, start_gateway
from bench.routing.overhead_bench import Placement, place
from e2e.procs import HOST, ManagedProcess, free_port

logger = logging.getLogger("overhead_sim")
_SHARED_TEXT = "You are a careful assistant who answers questions about the attached notes. "
_IDLE_WINDOW_S = 3.0
_BLOCK_SIZE = 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--replicas", type=int, nargs="+", default=[16, 64], help="per concurrency level")
    p.add_argument("--rounds", type=int, nargs="+", default=[8, 3], help="per concurrency level")
    p.add_argument("--requests-per-stream", type=int, default=6, help="requests per round = this x streams")
    p.add_argument("--output-tokens", type=int, nargs="+", default=[32, 16], help="per concurrency level")
    p.add_argument(
        "--fleet-tok-s", type=float, default=2000.0, help="the fleet's decode rate (sets the step)"
    )
    p.add_argument("--prompt-chars", type=int, default=2048)
    p.add_argument("--shared-chars", type=int, default=1024, help="leading characters every prompt shares")
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "corral" / "demo-model")
    p.add_argument("--layout", choices=("gateway-alone", "split", "shared"), default="gateway-alone")
    p.add_argument(
        "--gateway-setting", action="append", default=[], metavar="KEY=YAML", help="extra gateway setting"
    )
    p.add_argument(
        "--baseline-gateway",
        type=Path,
        default=None,
        metavar="DIR",
        help="a folder holding another corral_gateway package (an older commit's gateway/): run it as a "
        "third arm, `baseline`, in the same rounds, for a before/after in one run",
    )
    p.add_argument(
        "--baseline-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="run a `baseline` arm with this environment variable set in its gateway (this checkout's "
        "gateway unless --baseline-gateway names another): an A/B of one setting, e.g. "
        "CORRAL_GC_THRESHOLDS=700,10,10",
    )
    p.add_argument("--py-spy", type=Path, default=None, help="py-spy binary: record each gateway's first arm")
    p.add_argument("--out", type=Path, default=Path("bench/results/overhead-sim"))
    args = p.parse_args(argv)
    for name in ("replicas", "rounds", "output_tokens"):
        if len(getattr(args, name)) != len(args.concurrency):
            p.error(f"--{name.replace('_', '-')} needs one value per --concurrency level")
    return args


def sim_profile(step_s: float, max_num_seqs: int, num_kv_blocks: int) -> dict[str, Any]:
    """A fitted-profile file's content: every step takes `step_s`, whatever the batch, and a step
    may hold every stream (sequences, tokens), so nothing waits in a replica for room."""
    return {
        "kind": "fitted",
        "name": f"fixed-{1000 * step_s:.0f}ms",
        "coefficients": [step_s, 0.0, 0.0, 0.0, 0.0],
        "num_kv_blocks": num_kv_blocks,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 1 << 20,
        "max_model_len": 8192,
        "block_size": _BLOCK_SIZE,
    }


def kv_blocks_per_replica(concurrency: int, num_replicas: int, prompt_chars: int, output_tokens: int) -> int:
    """Four times a replica's even share of the streams' KV (the demo tokenizer makes ~1.9
    characters a token), so usage stays far below the gateway's saturation threshold even where
    routing piles streams up; a simulated block is a Python object, so no more than that."""
    blocks_per_stream = (prompt_chars // 2 + output_tokens) // _BLOCK_SIZE + 2
    return max(1024, 4 * concurrency * blocks_per_stream // num_replicas)


def prompts(
    num_requests: int, prompt_chars: int, shared_chars: int, output_tokens: int
) -> list[BenchRequest]:
    """Prompts of `prompt_chars` characters: a shared head, then text that starts with the request's
    number, so no two prompts share a block of characters past the head."""
    head = (_SHARED_TEXT * (shared_chars // len(_SHARED_TEXT) + 1))[:shared_chars]
    out = []
    for i in range(num_requests):
        tail = f"{i} Question {i}: what does note {i} say? " * (prompt_chars // 30 + 1)
        text = (head + tail)[:prompt_chars]
        out.append(BenchRequest(prompt=text, prompt_len=prompt_chars // 4, output_len=output_tokens))
    return out


def free_port_range(count: int) -> int:
    """A first port with `count` free consecutive ports after it (checked by binding each)."""
    for base in range(20_000, 60_000 - count, 997):
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def start_sim_fleet(model_dir: Path, work_dir: Path, profile_path: Path, num_replicas: int) -> ManagedProcess:
    """`corral engine --simulate` with `num_replicas` replicas in one process, every one ready."""
    base = free_port_range(num_replicas)
    argv = [sys.executable, "-m", "corral_cli.main", "--log-level", "warning", "engine", "--simulate"]
    argv += [str(profile_path), "--model", str(model_dir), "--served-model-name", MODEL]
    argv += ["--replicas", str(num_replicas), "--host", HOST, "--port", str(base)]
    fleet = ManagedProcess(argv, base, name="sim-fleet", log_dir=work_dir)
    fleet.wait_ready(120)
    with httpx.Client(timeout=10) as client:
        for port in range(base, base + num_replicas):
            client.get(f"http://{HOST}:{port}/health").raise_for_status()
    return fleet


def start_gateway_from(
    source: Path | None,
    urls: list[str],
    work_dir: Path,
    settings: dict[str, Any],
    extra_env: dict[str, str] | None = None,
) -> ManagedProcess:
    """A gateway in front of `urls`; with `source`, its corral_gateway package comes from there;
    `extra_env` is set in its environment."""
    if source is None and not extra_env:
        return start_gateway({MODEL: urls}, work_dir, **settings)
    port = free_port()
    config = work_dir / f"gateway-{port}.yaml"
    config.write_text(yaml.safe_dump({"backends": {MODEL: urls}, **settings}))
    argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", HOST, "--port", str(port)]
    env = dict(extra_env or {})
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(source.resolve()), os.environ.get("PYTHONPATH", "")) if p
        )
    gateway = ManagedProcess(
        [*argv, "--config", str(config)], port, name="gateway-baseline", log_dir=work_dir, env=env
    )
    gateway.wait_ready(60)
    return gateway


def replica_urls(fleet: ManagedProcess, num_replicas: int) -> list[str]:
    return [f"http://{HOST}:{fleet.port + i}" for i in range(num_replicas)]


async def closed_loop(
    urls: Sequence[str], requests: Sequence[BenchRequest], concurrency: int
) -> tuple[list[RequestResult], float]:
    """`concurrency` clients, each sending its next request as soon as the last one ended; request k
    goes to urls[k % len(urls)] (one URL: all to it)."""
    settings = [RequestSettings(base_url=url, model=MODEL, ignore_eos=True) for url in urls]
    queue = list(reversed(requests))
    turn = itertools.count()
    results: list[RequestResult] = []
    async with make_client(REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                request = queue.pop()
                results.append(await send_request(client, settings[next(turn) % len(settings)], request))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


class PySpy:
    """py-spy recording a process until stopped (SIGINT makes it write its samples: collapsed stacks,
    one line each, the input of flamegraph tools and easy to total by function)."""

    def __init__(self, binary: Path, pid: int, out: Path) -> None:
        argv = [str(binary), "record", "--pid", str(pid), "--rate", "250", "--nonblocking"]
        argv += ["--format", "raw", "--output", str(out)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_REPLICA_HISTOGRAMS = {"ttft": wire.TIME_TO_FIRST_TOKEN_SECONDS, "e2el": wire.E2E_REQUEST_LATENCY_SECONDS}


def replica_latency_totals(urls: Sequence[str]) -> dict[str, float]:
    """The replicas' own TTFT and E2E histograms (`/metrics`: sum and count, all replicas together).
    Their difference over an arm gives the mean latency the replicas saw, from the request's
    arrival in the replica's server, whoever sent it."""
    totals = dict.fromkeys((f"{k}_{part}" for k in _REPLICA_HISTOGRAMS for part in ("sum", "count")), 0.0)
    with httpx.Client(timeout=30.0) as client:
        for url in urls:
            for key, value in latency_totals(client.get(f"{url}/metrics").raise_for_status().text).items():
                totals[key] += value
    return totals


def latency_totals(metrics_text: str) -> dict[str, float]:
    """One exposition's TTFT and E2E histogram sums and counts, over all label sets."""
    totals = dict.fromkeys((f"{k}_{part}" for k in _REPLICA_HISTOGRAMS for part in ("sum", "count")), 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for key, name in _REPLICA_HISTOGRAMS.items():
            if family.name == name:
                for sample in family.samples:
                    part = sample.name.removeprefix(name).lstrip("_")
                    if part in ("sum", "count"):
                        totals[f"{key}_{part}"] += sample.value
    return totals


def run_arm(
    urls: Sequence[str],
    requests: Sequence[BenchRequest],
    concurrency: int,
    pids: dict[str, int],
    spy: tuple[Path, Path] | None = None,
    replicas: Sequence[str] = (),
    gateway: str | None = None,
) -> dict[str, Any]:
    """One closed loop, with the CPU each process used during it and how long its threads waited
    for a core (a shared machine's other work shows there); with `replicas`, also the mean latency
    the replicas themselves saw (their histograms' change over the loop); with `gateway` (its URL),
    the gateway's own overhead histogram's change over the loop."""
    replica_before = replica_latency_totals(replicas) if replicas else None
    gateway_before = gateway_overhead(gateway) if gateway is not None else None
    collector_before = gateway_collector(gateway) if gateway is not None else None
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    waited = {name: runqueue_wait_s(pid) for name, pid in pids.items()}
    client_before = time.process_time()
    recorder = PySpy(spy[0], pids["gateway"], spy[1]) if spy is not None else None
    try:
        results, duration_s = run_async(closed_loop(urls, requests, concurrency))
    finally:
        if recorder is not None:
            recorder.stop()
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    used["client"] = time.process_time() - client_before
    summary = report.arm_summary(results, duration_s, used)
    if replica_before is not None:
        after = replica_latency_totals(replicas)
        summary.update(report.hop_summary(results, {k: after[k] - replica_before[k] for k in after}))
    if gateway is not None and gateway_before is not None:
        change = report.overhead_change(gateway_overhead(gateway), gateway_before)
        summary["gateway_overhead"] = change
        summary.update(report.overhead_figures(change))
    if gateway is not None and collector_before is not None:
        after_passes = gateway_collector(gateway)
        summary.update({k: after_passes[k] - collector_before[k] for k in after_passes})
    for name, pid in pids.items():
        # Seconds spent runnable but not running, per CPU second used (the main thread's).
        summary[f"{name}_runqueue_wait_per_cpu_s"] = (runqueue_wait_s(pid) - waited[name]) / max(
            1e-9, used[name]
        )
    return summary


def gateway_overhead(url: str) -> dict[str, dict[str, Any]]:
    """The gateway's own overhead histogram, per part, from its /metrics."""
    with httpx.Client(timeout=30.0) as client:
        return report.overhead_histograms(client.get(f"{url}/metrics").raise_for_status().text)


def gateway_collector(url: str) -> dict[str, float]:
    """The gateway's collector passes so far: seconds in all passes, full passes and their seconds."""
    with httpx.Client(timeout=30.0) as client:
        return report.collector_totals(client.get(f"{url}/metrics").raise_for_status().text)


def runqueue_wait_s(pid: int) -> float:
    """Seconds a process's main thread has waited on a run queue (Linux /proc schedstat)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def idle_cores(pid: int, window_s: float = _IDLE_WINDOW_S) -> float:
    """Cores a process keeps busy with no traffic (the gateway: load polls, gauges)."""
    before = cpu_seconds(pid)
    time.sleep(window_s)
    return (cpu_seconds(pid) - before) / window_s


def run_level(args: argparse.Namespace, level: int, model_dir: Path, cores: Placement) -> dict[str, Any]:
    concurrency, num_replicas = args.concurrency[level], args.replicas[level]
    step_s = concurrency / args.fleet_tok_s
    num_requests = args.requests_per_stream * concurrency
    requests = prompts(num_requests, args.prompt_chars, args.shared_chars, args.output_tokens[level])
    extra = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.gateway_setting)}
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-overhead-sim-")))
        profile_path = work_dir / "profile.json"
        num_blocks = kv_blocks_per_replica(
            concurrency, num_replicas, args.prompt_chars, args.output_tokens[level]
        )
        profile_path.write_text(json.dumps(sim_profile(step_s, concurrency, num_blocks)))
        os.sched_setaffinity(0, cores.engine)  # children inherit this process's affinity
        fleet = stack.enter_context(start_sim_fleet(model_dir, work_dir, profile_path, num_replicas))
        urls = replica_urls(fleet, num_replicas)
        os.sched_setaffinity(0, cores.gateway)
        gateways = {"gateway": stack.enter_context(start_gateway_from(None, urls, work_dir, extra))}
        if args.baseline_gateway is not None or args.baseline_env:
            baseline_env = env_pairs(args.baseline_env)
            baseline = start_gateway_from(args.baseline_gateway, urls, work_dir, extra, baseline_env)
            gateways["baseline"] = stack.enter_context(baseline)
        os.sched_setaffinity(0, cores.client)
        targets = {"direct": urls, **{name: [g.url] for name, g in gateways.items()}}
        idle = {name: idle_cores(g.proc.pid) for name, g in gateways.items()}
        logger.info("%d streams, %d replicas, step %.0f ms; gateways idle: %s cores",
                    concurrency, num_replicas, 1000 * step_s, idle)  # fmt: skip
        for urls_of in targets.values():  # warm-up: connections, the replicas' prefix caches
            run_async(closed_loop(urls_of, requests[:concurrency], concurrency))
        if args.py_spy is not None:  # an extra loop per gateway under the profiler, not counted
            for name, g in gateways.items():
                spy = (args.py_spy, args.out / f"py-spy-{name}-{concurrency}.txt")
                run_arm(targets[name], requests, concurrency, {"gateway": g.proc.pid}, spy)
        pids = {name: {"gateway": gateways.get(name, gateways["gateway"]).proc.pid, "sim": fleet.proc.pid}
                for name in targets}  # fmt: skip
        rounds = run_rounds(args.rounds[level], targets, requests, concurrency, pids)
        queue_wait_s = {
            name: g.metric("corral_gateway_queue_wait_seconds_sum") for name, g in gateways.items()
        }
    summary = {name: report.paired(rounds, name, idle[name]) for name in gateways}
    for name in gateways:
        summary[name]["gateway_queue_wait_s"] = queue_wait_s[name]
    return {
        "concurrency": concurrency,
        "num_replicas": num_replicas,
        "step_ms": 1000 * step_s,
        "output_tokens": args.output_tokens[level],
        "summary": summary,
        "rounds": rounds,
    }


def run_rounds(
    num_rounds: int,
    targets: dict[str, list[str]],
    requests: Sequence[BenchRequest],
    concurrency: int,
    pids: dict[str, dict[str, int]],
) -> list[dict[str, dict[str, Any]]]:
    """Every arm once a round, in an order that rotates, so a steady drift favours no arm (an
    arm's `pids`: the processes whose CPU it reports; direct: the gateway idling meanwhile). Each
    arm starts with an uncounted loop of `concurrency` requests: the gateway's pooled connections
    to the replicas close after 4 s idle (below uvicorn's 5 s), so without it a gateway arm after
    the direct one would open them again inside its counted loop (a median of 33 ms each here)."""
    names = list(targets)
    rounds = []
    for round_index in range(num_rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        arms: dict[str, dict[str, Any]] = {}
        for name in order:
            gateway = targets[name][0] if name != "direct" else None
            run_async(closed_loop(targets[name], requests[:concurrency], concurrency))
            arms[name] = run_arm(
                targets[name], requests, concurrency, pids[name], replicas=targets["direct"], gateway=gateway
            )
            logger.info("%d streams, round %d, %s: %s", concurrency, round_index, name,
                        {k: v for k, v in arms[name].items()
                         if not k.endswith("_s") and k != "gateway_overhead"})  # fmt: skip
        rounds.append(arms)
    return rounds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = ensure_model(args.model_dir, "tiny")
    cores = place(args.layout)
    logger.info("cores: sim %s, gateway %s, client %s", sorted(cores.engine), sorted(cores.gateway),
                sorted(cores.client))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    levels = [run_level(args, level, model_dir, cores) for level in range(len(args.concurrency))]
    settings = {k: str(v) for k, v in vars(args).items()}
    (args.out / "overhead_sim.json").write_text(json.dumps({"args": settings, "levels": levels}, indent=2))
    report.plot(levels, args.out / "overhead_sim.png")
    logger.info("results in %s\n%s", args.out, report.table(levels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
