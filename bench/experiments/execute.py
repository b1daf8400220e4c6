"""Run an experiment: one engine process per engine setting, load from `corral bench`'s library.

Every run gets fresh random prompts (same lengths for the same seed), so no run hits the prefix
cache with an earlier run's prompts; each engine is warmed up before its first measured run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from corral_cli.bench import workload
from corral_cli.bench.client import RequestSettings, send_request
from corral_cli.bench.report import rate_label
from corral_cli.bench.runner import RunSettings, make_client, run_async, run_once
from corral_engine.model_args import DEFAULT_BLOCK_SIZE

from bench.experiments.source import EngineSource
from bench.experiments.specs import EngineConfig, Experiment, RunSpec, group_by_engine, kv_bytes_per_token
from e2e.procs import EngineProcess, free_port

log = logging.getLogger("experiments")

SERVED_MODEL = "exp"
# The tiny preset's 512-token context is too short for ShareGPT-like lengths (prompt up to 1024
# plus a 512-token cap): the experiments' tiny model is the same preset with a 2048-token context.
CONTEXT_LEN = 2048
REQUEST_TIMEOUT_S = 600.0
ENGINE_START_TIMEOUT_S = 120.0
NUM_WARMUP_REQUESTS = 4
_WARMUP_VARIANT = 1_000_000


def ensure_model(model_dir: Path, preset: str) -> Path:
    """The demo checkpoint at `model_dir`, written first if it is not there."""
    if not (model_dir / "config.json").is_file():
        from corral_engine.demo_model import write_demo_model

        log.info("writing the %s demo model to %s", preset, model_dir)
        overrides = {"max_position_embeddings": CONTEXT_LEN} if preset == "tiny" else None
        write_demo_model(model_dir, preset=preset, config_overrides=overrides)
    return model_dir


def run_record(spec: RunSpec, summary: dict[str, Any]) -> dict[str, Any]:
    """One flat row: the engine and load settings, then `corral bench`'s run summary."""
    lengths = spec.load.lengths
    return {
        "variant": spec.variant,
        "max_num_seqs": spec.engine.max_num_seqs,
        "num_kv_blocks": spec.engine.num_kv_blocks,
        "kv_policy": spec.engine.kv_policy,
        "max_tokens_cap": spec.load.max_tokens_cap,
        "length_dist": lengths.dist,
        "input_len": lengths.input_len,
        "output_len": lengths.output_len,
        "seed": spec.load.seed,
        **summary,
    }


async def _warm_up(url: str, token_ids: np.ndarray) -> None:
    requests = workload.sample_random(
        NUM_WARMUP_REQUESTS, workload.LengthSpec(16, 4), 0, token_ids, variant=_WARMUP_VARIANT
    )
    settings = RequestSettings(url, SERVED_MODEL, ignore_eos=True)
    async with make_client(REQUEST_TIMEOUT_S) as client:
        await asyncio.gather(*(send_request(client, settings, r) for r in requests))


async def _run_group(
    url: str, specs: list[RunSpec], token_ids: np.ndarray, first_variant: int, show_progress: bool
) -> list[dict[str, Any]]:
    await _warm_up(url, token_ids)
    records = []
    async with make_client(REQUEST_TIMEOUT_S) as client:
        for i, spec in enumerate(specs):
            load = spec.load
            requests = workload.sample_random(
                load.num_prompts, load.lengths, load.seed, token_ids, variant=first_variant + i
            )
            settings = RequestSettings(url, SERVED_MODEL, ignore_eos=True, max_tokens_cap=load.max_tokens_cap)
            run = RunSettings(
                load.request_rate, seed=load.seed, metrics_url=url + "/metrics", show_progress=show_progress
            )
            outcome = await run_once(client, settings, run, requests)
            records.append(run_record(spec, outcome.summary))
            _log_run(spec, outcome.summary)
    return records


def _log_run(spec: RunSpec, s: dict[str, Any]) -> None:
    log.info(
        "%s rate %s: %d ok / %d failed, %.0f out tok/s, TTFT p99 %.0f ms, %s preemptions",
        _engine_label(spec.engine) + (f" [{spec.variant}]" if spec.variant else ""),
        rate_label(spec.load.request_rate),
        s["completed"],
        s["failed"],
        s["output_throughput"],
        s["p99_ttft_ms"],
        s["num_preemptions"],
    )
    if s["failed"]:
        log.warning("failures: %s", s["errors"])


def _engine_label(engine: EngineConfig) -> str:
    blocks = "default" if engine.num_kv_blocks is None else str(engine.num_kv_blocks)
    return f"max_num_seqs {engine.max_num_seqs}, {blocks} KV blocks, {engine.kv_policy}"


def run_experiment(
    experiment: Experiment,
    model_dir: Path,
    preset: str,
    out_dir: Path,
    *,
    source: EngineSource,
    quick: bool,
    show_progress: bool,
) -> dict[str, Any]:
    """Run every setting of `experiment`; returns the result document (also for `tables`/`plots`)."""
    config = json.loads((model_dir / "config.json").read_text())
    token_ids = workload.allowed_token_ids(workload.HFTokenizer(model_dir), None)
    log_dir = out_dir / "logs"
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    groups = group_by_engine(experiment.runs)
    for n, (engine, specs) in enumerate(groups, start=1):
        log.info("%s: engine %d/%d (%s)", experiment.name, n, len(groups), _engine_label(engine))
        flags = engine.flags()
        flags["served_model_name"] = SERVED_MODEL
        # Entered before waiting for health, so an interrupt while it starts still stops it.
        with EngineProcess(model_dir, free_port(), flags, log_dir=log_dir, env=source.env) as proc:
            proc.wait_ready(ENGINE_START_TIMEOUT_S)
            records += run_async(_run_group(proc.url, specs, token_ids, len(records), show_progress))
    return {
        "experiment": experiment.name,
        "title": experiment.title,
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "preset": preset,
        "engine_source": source.description,
        "model_dir": str(model_dir),
        "context_len": int(config["max_position_embeddings"]),
        "kv_bytes_per_token": kv_bytes_per_token(config),
        "block_size": DEFAULT_BLOCK_SIZE,
        "quick": quick,
        "num_cpus": os.cpu_count(),
        "wall_time_s": round(time.monotonic() - started, 1),
        "runs": records,
    }
