"""The engine server's own CPU per output token, without the model: `corral engine --simulate`
(the real server, scheduler and streaming; each step a fixed sleep) replayed with `corral bench`.

    .venv/bin/python bench/engine/stream_cost.py [--workloads W1,W2] [--rounds 3]
        [--ref-dir DIR] [--ref-env NAME=VALUE] [--no-stream] [--rate REQUESTS_PER_S]

The served engine's event loop shares two cores with its step thread; every µs it spends per token
is a µs the steps lose (docs/engine-speed.md, "Served against offline on two cores"). With the model
out of the way, what is left to measure is the HTTP side: request handling, the per-step delivery of
outputs, chunk encoding, the ASGI send and the socket write, plus the simulator's own scheduling
(the same in both arms of an A/B). The server's CPU comes from /proc per thread (`proc_cpu.py`), the
load generator's from its own report. `--ref-dir` runs another checkout's packages (its engine/,
cli/, gateway/ and operator/ first on PYTHONPATH) as the server in alternate rounds, so both arms
meet the same machine; the load generator is this checkout's in both. `--ref-env NAME=VALUE`
(repeatable) sets a variable for the reference arm's server only; without `--ref-dir` the reference
arm is this checkout, so e.g. `--ref-env CORRAL_GC_THRESHOLDS=700,10,10` is an A/B of one setting.
`--no-stream` sends the same workloads as non-streamed requests (one JSON response each: the
server's cost per token of batch-style traffic). Each row also gives the CPU per request: with
`--workloads R1 --rate 150` (1,500 two-token requests arriving at 150 a second, so the queue stays
short) that is the per-request work alone (parsing, routing, admission, the response's start and
end, the access line). Each row also gives the clients' TTFT p50/p99 and the server's garbage-
collector passes during the workload (from its `corral_engine_gc_pause_seconds`): with `--workloads
B1` (3,000 requests at once) those are what a burst costs; the server's peak RSS so far comes with
them. Writes JSON and a PNG plot to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import compare
import engine_metrics
import proc_cpu
import runner
import workloads
from corral_cli.flags import key_values

log = logging.getLogger("stream_cost")
REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "cli", "gateway", "operator")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="W1,W2", help="from workloads.py (all at once)")
    p.add_argument("--no-stream", action="store_true", help="non-streamed requests (default: streamed)")
    p.add_argument("--rate", default="inf", help="request rate for every workload (default: all at once)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=10.0, help="each simulated step's fixed time")
    p.add_argument("--token-us", type=float, default=50.0, help="and its time per batched token")
    p.add_argument("--ref-dir", type=Path, help="another checkout to measure in alternate rounds")
    p.add_argument(
        "--ref-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the reference arm's server (repeatable; without --ref-dir "
        "the reference arm is this checkout)",
    )
    p.add_argument("--out-dir", type=Path, help="default: bench/results/stream-cost-<UTC time>")
    return p.parse_args()


def write_profile(path: Path, step_ms: float, token_us: float) -> Path:
    """A fitted profile whose step takes step_ms plus token_us per batched token, no more."""
    profile = {
        "name": "fixed-step",
        "kind": "fitted",
        "coefficients": [step_ms / 1e3, 0.0, token_us / 1e6, 0.0, 0.0],
        "num_kv_blocks": 20000,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "max_model_len": 4096,
    }
    path.write_text(json.dumps(profile))
    return path


def env_for(checkout: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(checkout / p) for p in PACKAGES)
    env.update(extra or {})
    return env


def parse_env(pairs: list[str]) -> dict[str, str]:
    try:
        return key_values(pairs, "--ref-env", "NAME=VALUE")
    except ValueError as e:
        raise SystemExit(str(e)) from None


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gc_passes(side: dict[str, Any] | None) -> dict[str, float]:
    """The collector's passes between two scrapes (`engine_metrics.delta`): full (generation 2)
    count and seconds, and all generations' seconds; NaN when a scrape failed."""
    if side is None:
        return dict.fromkeys(("gc_full_passes", "gc_full_s", "gc_s"), float("nan"))
    full, every = side.get("gc_full_s"), side.get("gc_s")  # absent: no pass between the scrapes
    return {
        "gc_full_passes": full["count"] if full else 0.0,
        "gc_full_s": full["count"] * full["mean"] if full else 0.0,
        "gc_s": every["count"] * every["mean"] if every else 0.0,
    }


def bench(
    base_url: str,
    model: Path,
    dataset: Path,
    num: int,
    out: Path,
    env: dict[str, str],
    stream: bool,
    rate: str = "inf",
) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "corral_cli.main", "bench", "--base-url", base_url, "--dataset", str(dataset),
        "--num-prompts", str(num), "--tokenizer", str(model), "--ignore-eos", "--request-rate", rate,
        "--seed", "0", "--no-progress", "--result-file", str(out), "--temperature", "0",
    ]  # fmt: skip
    if not stream:
        cmd.append("--no-stream")
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    run: dict[str, Any] = json.loads(out.read_text())["runs"][0]
    return run


def measure(
    arm: str,
    checkout: Path | None,
    profile: Path,
    model: Path,
    sets: dict[str, tuple[Path, int]],
    args: argparse.Namespace,
    work: Path,
    extra_env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One server of this arm, a warm-up, then each workload once: CPU per output token."""
    env, client_env = env_for(checkout, extra_env), env_for(None)
    port = runner.free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "corral_cli.main",
        "engine",
        "--simulate",
        str(profile),
        "--model",
        str(model),
    ]
    argv += ["--port", str(port), "--max-num-seqs", "256"]
    with open(work / f"server-{arm}.log", "ab") as server_log:
        server = subprocess.Popen(argv, env=env, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            problem = runner.wait_ready(base_url, server, 120.0)
            if problem is not None:
                raise RuntimeError(f"the simulated engine: {problem}")
            first = next(iter(sets.values()))
            bench(base_url, model, first[0], 4, work / "warmup.json", client_env, not args.no_stream)
            rows = []
            for name, (dataset, num) in sets.items():
                metrics_before = engine_metrics.scrape(base_url)
                before = proc_cpu.snapshot(server.pid)
                out = work / f"{arm.replace(' ', '-')}-{name}.json"
                run = bench(base_url, model, dataset, num, out, client_env, not args.no_stream, args.rate)
                used = proc_cpu.delta(before, proc_cpu.snapshot(server.pid), server.pid)
                side = engine_metrics.delta(metrics_before, engine_metrics.scrape(base_url))
                tokens = int(run["total_output_tokens"])
                main = (used or {}).get("main_thread") or {}
                rows.append(
                    {
                        "arm": arm,
                        "workload": name,
                        "output_tokens": tokens,
                        "duration_s": run["duration_s"],
                        "server_cpu_s": (used or {}).get("cpu_s", float("nan")),
                        "ttft_p50_ms": run.get("median_ttft_ms", float("nan")),
                        "ttft_p99_ms": run.get("p99_ttft_ms", float("nan")),
                        **gc_passes(side),
                        "server_peak_rss_mb": peak_rss_mb(server.pid),
                        "server_us_per_token": 1e6 * (used or {}).get("cpu_s", float("nan")) / tokens,
                        "event_loop_us_per_token": 1e6 * main.get("cpu_s", float("nan")) / tokens,
                        "client_us_per_token": 1e6 * float(run.get("client_cpu_s") or float("nan")) / tokens,
                        "requests": num,
                        "server_us_per_request": 1e6 * (used or {}).get("cpu_s", float("nan")) / num,
                        "client_us_per_request": 1e6 * float(run.get("client_cpu_s") or float("nan")) / num,
                    }
                )
            return rows
        finally:
            server.terminate()
            server.wait(timeout=60)


def plot(rows: list[dict[str, Any]], path: Path, kind: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r["arm"] for r in rows})
    names = sorted({r["workload"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        medians = [
            statistics.median(
                r["server_us_per_token"] for r in rows if r["arm"] == arm and r["workload"] == n
            )
            for n in names
        ]
        ax.bar([j + i * width for j in range(len(names))], medians, width, label=arm)
    ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel(f"server CPU µs per {kind} token (median)")
    ax.set_title(f"Engine server's own cost per {kind} token (simulated steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args()
    out_dir = (
        args.out_dir
        or REPO / "bench" / "results" / f"stream-cost-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model = compare.ensure_model()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    sets = {}
    for name in names:
        records = workloads.build(name, model)
        sets[name] = (workloads.write(records, out_dir / "workloads" / f"{name}.jsonl"), len(records))
    ref_env = parse_env(args.ref_env)
    arms: list[tuple[str, Path | None, dict[str, str]]] = [("this checkout", None, {})]
    if args.ref_dir is not None or ref_env:
        label = " ".join(
            [
                f"ref {args.ref_dir.name}" if args.ref_dir is not None else "ref",
                *(f"{k}={v}" for k, v in ref_env.items()),
            ]
        )
        arms.insert(0, (label, args.ref_dir.resolve() if args.ref_dir is not None else None, ref_env))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = write_profile(Path(tmp) / "fixed-step.json", args.step_ms, args.token_us)
        for round_ in range(args.rounds):
            for arm, checkout, extra_env in arms:
                for row in measure(arm, checkout, profile, model, sets, args, out_dir, extra_env):
                    row["round"] = round_ + 1
                    rows.append(row)
                    log.info(
                        "round %d, %s, %s: server %.1f µs/token (event loop %.1f), client %.1f, %.2f s;"
                        " server %.0f µs/request; TTFT p99 %.0f ms; collector %.2f s (%d full passes);"
                        " peak RSS %.0f MiB",
                        round_ + 1, arm, row["workload"], row["server_us_per_token"],
                        row["event_loop_us_per_token"], row["client_us_per_token"], row["duration_s"],
                        row["server_us_per_request"], row["ttft_p99_ms"], row["gc_s"], row["gc_full_passes"],
                        row["server_peak_rss_mb"],
                    )  # fmt: skip
    lines = [
        "| arm | workload | server µs/token (median) | event loop | client | each round (server) "
        "| server µs/request (median) | client µs/request | TTFT p99 ms | collector s (full passes) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    keys = ("server_us_per_token", "event_loop_us_per_token", "client_us_per_token")
    for arm, _, _ in arms:
        for name in names:
            mine = [r for r in rows if r["arm"] == arm and r["workload"] == name]
            server, loop, client = (statistics.median(r[k] for r in mine) for k in keys)
            per_request = statistics.median(r["server_us_per_request"] for r in mine)
            client_per_request = statistics.median(r["client_us_per_request"] for r in mine)
            each = ", ".join(f"{r['server_us_per_token']:.1f}" for r in mine)
            ttft_p99 = statistics.median(r["ttft_p99_ms"] for r in mine)
            collector = statistics.median(r["gc_s"] for r in mine)
            full = statistics.median(r["gc_full_passes"] for r in mine)
            lines.append(
                f"| {arm} | {name} | {server:.1f} | {loop:.1f} | {client:.1f} | {each} "
                f"| {per_request:.0f} | {client_per_request:.0f} | {ttft_p99:.0f} "
                f"| {collector:.2f} ({full:.0f}) |"
            )
    table = "\n".join(lines)
    (out_dir / "table.md").write_text(table + "\n")
    log.info("\n%s", table)
    result = {
        "command": " ".join(["bench/engine/stream_cost.py", *sys.argv[1:]]),
        "machine": compare.machine_info(),
        "stream": not args.no_stream,
        "rate": args.rate,
        "rows": rows,
    }
    (out_dir / "stream-cost.json").write_text(json.dumps(result, indent=1))
    kind = "non-streamed" if args.no_stream else "streamed"
    log.info("wrote %s and %s", out_dir / "stream-cost.json", plot(rows, out_dir / "stream-cost.png", kind))
    return 0


if __name__ == "__main__":
    sys.exit(main())
