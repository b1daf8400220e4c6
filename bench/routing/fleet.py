"""Processes and load for the routing benchmarks: engines, a gateway, and an open-loop client."""

from __future__ import annotations

import asyncio
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

from e2e.procs import HOST, ManagedProcess, free_port

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
