"""Processes and load for the routing benchmarks: engines, a gateway, and an open-loop client."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from corral_cli.bench.client import RequestSettings, send_request
from corral_cli.bench.runner import make_client
from corral_cli.bench.stats import RequestResult
from corral_cli.bench.workload import BenchRequest
from corral_cli.flags import key_values

from bench.engine.proc_cpu import stat_cpu_s
from e2e.procs import HOST, EngineProcess, ManagedProcess, free_port, start_engine

MODEL = "bench"
REQUEST_TIMEOUT_S = 600.0


def start_gateway(backends: dict[str, list[str]], work_dir: Path, **settings: Any) -> ManagedProcess:
    port = free_port()
    config = work_dir / f"gateway-{port}.yaml"
    config.write_text(yaml.safe_dump({"backends": backends, **settings}))
    argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", HOST, "--port", str(port)]
    gateway = ManagedProcess([*argv, "--config", str(config)], port, name="gateway", log_dir=work_dir)
    gateway.wait_ready(60)
    return gateway


def add_closed_loop_args(parser: argparse.ArgumentParser) -> None:
    """The demo model and the closed loop of streams the overhead and served A/B benchmarks drive."""
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "corral" / "demo-model")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--output-tokens", type=int, default=64)


def stream_requests(num_requests: int, output_tokens: int) -> list[BenchRequest]:
    """Short distinct prompts, each generating `output_tokens` tokens (sent with ignore_eos)."""
    return [
        BenchRequest(prompt=f"Stream number {i} tells a story", prompt_len=8, output_len=output_tokens)
        for i in range(num_requests)
    ]


def start_loop_engine(
    model_dir: Path,
    work_dir: Path,
    name: str,
    concurrency: int,
    cpus: set[int],
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
    **flags: Any,
) -> EngineProcess:
    """An engine for a closed loop of `concurrency` streams, on `cpus` with `num_threads` model
    threads (default a thread per CPU; the process inherits this one's CPU affinity when it starts;
    the caller sets it back); `flags` are further `corral engine` flags by python name."""
    os.sched_setaffinity(0, cpus)
    return start_engine(
        model_dir,
        log_dir=work_dir,
        env=env,
        served_model_name=name,
        max_num_seqs=2 * concurrency,
        num_threads=num_threads or len(cpus),
        **flags,
    )


def env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """`NAME=VALUE` command-line items as a dict (a value may hold `=`); anything else exits."""
    try:
        return key_values(pairs, form="NAME=VALUE")
    except ValueError as e:
        raise SystemExit(str(e)) from None


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used so far."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's main thread (the event loop), of all its others, and of
    its child processes (an engine core in a process of its own)."""
    out = {"event_loop": 0.0, "other": 0.0, "children": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            used = stat_cpu_s(Path(f"/proc/{pid}/task/{tid}/stat"))
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:  # the thread ended between listing and reading
            continue
        out["event_loop" if int(tid) == pid else "other"] += used
        for child in children:
            with contextlib.suppress(OSError):  # gone since
                out["children"] += cpu_seconds(int(child))
    return out


def ensure_model(model_dir: Path, preset: str) -> Path:
    if not (model_dir / "config.json").exists():
        from corral_engine.demo_model import write_demo_model

        write_demo_model(model_dir, preset=preset)
    return model_dir


async def open_loop(
    base_url: str, requests: Sequence[BenchRequest], offsets_s: Sequence[float]
) -> tuple[list[RequestResult], float]:
    """Send each request at its offset (streamed); returns the results and the run's wall time."""
    settings = RequestSettings(base_url=base_url, model=MODEL, ignore_eos=True)
    async with make_client(REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()

        async def one(request: BenchRequest, offset_s: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
            return await send_request(client, settings, request)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets_s, strict=True)))
        return list(results), time.perf_counter() - start


async def closed_loop(
    base_url: str, requests: Sequence[BenchRequest], concurrency: int
) -> tuple[list[RequestResult], float]:
    """`concurrency` clients each sending their next request as soon as the last one finished."""
    settings = RequestSettings(base_url=base_url, model=MODEL, ignore_eos=True)
    queue = list(reversed(requests))
    results: list[RequestResult] = []
    async with make_client(REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                results.append(await send_request(client, settings, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def engine_counter(engines: Sequence[ManagedProcess], name: str) -> float:
    return sum(e.metric(name) for e in engines)
