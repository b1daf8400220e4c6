"""The GPU run's measuring phases but throughput (throughput.py): env, bandwidth, equality, batch1,
overhead. Each takes the Run and the results so far and returns its own JSON-ready figures."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform
import statistics
import subprocess
import time
from typing import Any

import torch
from corral_engine.demo_model import ARCHITECTURES
from corral_engine.sampling_params import SamplingParams

from bench.engine.profile_step import fill_batch
from bench.gpu import measure, reference
from bench.gpu.context import GPU_OPTIONS, Run, engine_fields, free_memory

log = logging.getLogger("gpu")

Results = dict[str, Any]


def env(run: Run, results: Results) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "device": str(run.device)}
    for package in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "absent"
    out["torch_cuda"] = torch.version.cuda
    out["engine_args_gpu_options"] = sorted(engine_fields() & set(GPU_OPTIONS))
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        out["gpu"] = props.name
        out["gpu_memory_bytes"] = props.total_memory
        out["gpu_multiprocessors"] = props.multi_processor_count
        out["nvidia_smi"] = _nvidia_smi()
    else:
        out["cpu_threads"] = torch.get_num_threads()
    log.info("env: %s", out)
    return out


def _nvidia_smi() -> str:
    query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.memory"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    return done.stdout.strip() or done.stderr.strip()


def bandwidth(run: Run, results: Results) -> dict[str, Any]:
    out = measure.bandwidth(run.device, run.profile.bandwidth_bytes, run.profile.bandwidth_repeats)
    free_memory(run.device)
    log.info(
        "bandwidth: read %.0f GB/s, copy %.0f GB/s (medians)",
        out["read_gb_s_median"],
        out["copy_gb_s_median"],
    )
    return out


def equality(run: Run, results: Results) -> dict[str, Any]:
    """Greedy output of every architecture's tiny checkpoint, float32, against transformers on the
    same device: all prompts at once through the engine, each alone through transformers."""
    p = run.profile
    variants: list[dict[str, Any]] = [{}]
    if "enforce_eager" in engine_fields():
        variants.append({"enforce_eager": True})  # graphs off: the eager path must agree too
    archs: dict[str, Any] = {}
    for arch in ARCHITECTURES:
        model_dir = run.model_dir("tiny", arch)
        prompts = reference.random_prompts(p.equality_prompts, 500, seed=sum(map(ord, arch)))
        model = reference.load_model(model_dir, run.device, torch.float32)
        want = reference.transformers_greedy(model, prompts, p.equality_new_tokens)
        del model
        free_memory(run.device)
        archs[arch] = {"num_prompts": len(prompts), "new_tokens": p.equality_new_tokens, "variants": []}
        for options in variants:
            engine, record = run.engine(model_dir, **run.equality_options(), **options)
            params = SamplingParams(max_tokens=p.equality_new_tokens, temperature=0.0, ignore_eos=True)
            got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
            diverged = [reference.first_divergence(g, w) for g, w in zip(got, want, strict=True)]
            archs[arch]["variants"].append(
                {
                    "engine": record,
                    "num_equal": sum(d is None for d in diverged),
                    "first_divergence": diverged,
                }
            )
            log.info(
                "equality %s %s: %d of %d prompts equal",
                arch,
                options or "default",
                archs[arch]["variants"][-1]["num_equal"],
                len(prompts),
            )
            del engine
        run.release()
    passed = all(v["num_equal"] == a["num_prompts"] for a in archs.values() for v in a["variants"])
    return {"passed": passed, "device": str(run.device), "dtype": "float32", "archs": archs}


def _decode_step_times(run: Run, engine: Any, request_id: str) -> list[float]:
    """Seconds of each decode step of one request alone (prefill steps left out)."""
    p = run.profile
    prompt = [100 + (7 * j) % 900 for j in range(p.batch1_prompt_len)]
    num = 1 + p.batch1_warmup_tokens + p.batch1_tokens
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=num, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        measure.sync(run.device)
        if engine.last_schedule:  # not the step that only hands back the last output (overlap on)
            times.append(time.perf_counter() - t0)
    # The first step computes the prompt and samples the first token; each later one decodes one.
    return times[1 + p.batch1_warmup_tokens :]


def batch1(run: Run, results: Results) -> dict[str, Any]:
    """Time per output token of one request alone, and the bandwidth it achieves, with CUDA graphs
    (the default) and, where the engine has the switch, without."""
    p = run.profile
    model_dir = run.model_dir(p.batch1_preset)
    config = json.loads((model_dir / "config.json").read_text())
    itemsize = torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
    context = p.batch1_prompt_len + 1 + p.batch1_warmup_tokens + p.batch1_tokens / 2  # mean, timed steps
    bytes_read = measure.decode_bytes_per_token(config, itemsize, context)
    read_gb_s = results.get("bandwidth", {}).get("read_gb_s_median")
    variants = [("eager", {"enforce_eager": True})] if "enforce_eager" in engine_fields() else []
    variants.append(("default", {}))  # last: the speed phases after this one reuse it
    out: dict[str, Any] = {"preset": p.batch1_preset, "dtype": p.dtype, **bytes_read, "variants": {}}
    for name, options in variants:
        engine, record = run.engine(model_dir, **run.speed_options(), **options)
        steps = _decode_step_times(run, engine, f"batch1-{name}")
        tpot_s = statistics.median(steps)
        figures: dict[str, Any] = {
            "engine": record,
            "num_tokens": len(steps),
            "tpot_ms": 1000 * tpot_s,
            "tpot_ms_mean": 1000 * statistics.fmean(steps),
            "step_ms": [round(1000 * s, 4) for s in steps],
            "achieved_gb_s": bytes_read["bytes_per_token"] / tpot_s / 1e9,
        }
        if read_gb_s:
            figures["mbu_ratio"] = figures["achieved_gb_s"] / read_gb_s
        out["variants"][name] = figures
        log.info(
            "batch1 %s: %.3f ms per token, %.0f GB/s, MBU %s",
            name,
            figures["tpot_ms"],
            figures["achieved_gb_s"],
            f"{figures.get('mbu_ratio', float('nan')):.1%}",
        )
        del engine  # the next variant's engine needs this one's device memory back
    if "eager" in out["variants"]:
        out["graphs_speedup"] = out["variants"]["eager"]["tpot_ms"] / out["variants"]["default"]["tpot_ms"]
    if not read_gb_s:
        out["note"] = "no bandwidth phase in this run: MBU left out"
    return out


def overhead(run: Run, results: Results) -> dict[str, Any]:
    """Share of a decode step's wall time outside device work, at each batch size: the profiler gives
    the device time (union of kernel intervals), a separate unprofiled stretch gives the wall time,
    so the profiler's own host cost does not count."""
    p = run.profile
    model_dir = run.model_dir(p.batch1_preset)
    engine, record = run.engine(model_dir, **run.speed_options())
    out: dict[str, Any] = {"preset": p.batch1_preset, "engine": record, "batches": {}}
    for batch in p.overhead_batches:
        out["batches"][str(batch)] = _overhead_at(run, engine, batch)
    return out


def _overhead_at(run: Run, engine: Any, batch: int) -> dict[str, Any]:
    p = run.profile
    prompts = [[100 + (7 * i + j) % 900 for j in range(p.overhead_prompt_len)] for i in range(batch)]
    fill_batch(engine, prompts, p.overhead_steps, SamplingParams(temperature=0.0))
    measure.sync(run.device)
    t0 = time.perf_counter()
    for _ in range(p.overhead_steps):
        engine.step()
    measure.sync(run.device)
    wall_s = (time.perf_counter() - t0) / p.overhead_steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(p.overhead_steps):
            engine.step()
        measure.sync(run.device)
    intervals, counted = measure.kernel_intervals(prof.events(), run.device)
    kernel_s = measure.union_us(intervals) / 1e6 / p.overhead_steps
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    # No events at all means the profiler saw no device work (not that there was none): no figure.
    outside = max(0.0, 1 - kernel_s / wall_s) if intervals else None
    figures: dict[str, Any] = {
        "num_steps": p.overhead_steps,
        "step_ms": 1000 * wall_s,
        "kernel_ms": 1000 * kernel_s,
        "outside_kernels_ratio": outside,
        "num_device_events": len(intervals),
        "counted": counted,
    }
    log.info("overhead at batch %d: step %.3f ms, kernels %.3f ms, outside %s", batch, 1000 * wall_s,
             1000 * kernel_s, "-" if outside is None else f"{outside:.1%}")  # fmt: skip  # fmt: skip
    return figures
