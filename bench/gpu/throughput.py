"""The throughput phase: W1/W2-shaped workloads (bench/engine/workloads.py) through Corral's offline
API, transformers' static batching and transformers' continuous batching, on the same device,
one system after another (each gives its memory back before the next starts).

Output tokens/s counts the tokens the requests asked for (ignore_eos, so exactly that many), over
the wall time of the whole workload, after a warm-up.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from corral_engine.sampling_params import SamplingParams

from bench.engine import hf_static, workloads
from bench.engine.worker_common import Request, time_throughput, warmup_requests
from bench.gpu import reference
from bench.gpu.context import Run, free_memory

log = logging.getLogger("gpu")

SYSTEMS = ("corral", "hf-static", "hf-cb")
WORKLOADS = ("W1", "W2")


def throughput(run: Run, results: dict[str, Any], systems: tuple[str, ...] = SYSTEMS) -> dict[str, Any]:
    p = run.profile
    model_dir = run.model_dir(p.throughput_preset)
    max_len = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    out: dict[str, Any] = {"preset": p.throughput_preset, "dtype": p.dtype, "workloads": {}, "systems": {}}
    loads: dict[str, list[Request]] = {}
    for name in WORKLOADS:
        loads[name], num_cut = workload_requests(name, model_dir, max_len, p.quick_workloads)
        records = [{"prompt": prompt, "output_len": n} for prompt, n in loads[name]]
        out["workloads"][name] = {**workloads.summary(records), "num_prompts_cut": num_cut}
    if "corral" in systems:
        out["systems"]["corral"] = _guarded(lambda: _corral(run, model_dir, loads))
        run.release()
    if {"hf-static", "hf-cb"} & set(systems):
        run.release()  # also an engine an earlier phase of this call left alive
        model = reference.load_model(model_dir, run.device, getattr(torch, p.dtype))
        if "hf-static" in systems:
            out["systems"]["hf-static"] = _guarded(lambda: _hf_static(run, model, loads))
            free_memory(run.device)  # continuous batching sizes its cache from the free memory
        if "hf-cb" in systems:
            out["systems"]["hf-cb"] = _guarded(lambda: _hf_continuous(run, model, loads))
        del model
        free_memory(run.device)
    out["ratios"] = ratios(out["systems"])
    return out


def workload_requests(name: str, model_dir: Any, max_len: int, quick: bool) -> tuple[list[Request], int]:
    """The workload's requests, and how many prompts were cut to fit prompt + output into the
    model's context (only the small smoke models need it)."""
    out, num_cut = [], 0
    for r in workloads.build(name, model_dir, seed=0, quick=quick):
        prompt, num_out = list(r["prompt"]), int(r["output_len"])  # type: ignore[call-overload]
        room = max_len - num_out - 1
        num_cut += len(prompt) > room
        out.append((prompt[:room], num_out))
    return out, num_cut


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A system that fails is reported (error and traceback tail) and the others still run."""
    try:
        return fn()
    except Exception as e:  # a failing system is a result to report
        log.exception("system failed")
        return {
            "status": "error",
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-2000:],
        }


def _corral(run: Run, model_dir: Any, loads: dict[str, list[Request]]) -> dict[str, Any]:
    engine, record = run.engine(model_dir, **run.speed_options())

    def generate(requests: list[Request]) -> int:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        outputs = engine.generate([p for p, _ in requests], params)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    generate(warmup_requests())
    out: dict[str, Any] = {"status": "ok", "engine": record, "workloads": {}}
    for name, requests in loads.items():
        out["workloads"][name] = time_throughput(generate, requests)
        log.info("corral %s: %.1f output tok/s", name, out["workloads"][name]["output_throughput"])
    return out


def _hf_static(run: Run, model: Any, loads: dict[str, list[Request]]) -> dict[str, Any]:
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    hf_static.generate_batched(model, warmup_requests(), 4, pad_id)
    out: dict[str, Any] = {"status": "ok", "padding": "left", "workloads": {}}
    budget = run.profile.hf_budget_s
    for name, requests in loads.items():

        def once(batch_size: int, requests: list[Request] = requests) -> hf_static.BatchedRun:
            deadline = None if budget is None else time.perf_counter() + budget
            return hf_static.generate_batched(model, requests, batch_size, pad_id, deadline)

        for figures in hf_static.best_batch(name, requests, list(run.profile.hf_batch_sizes[name]), once):
            out["workloads"][name] = figures
        log.info(
            "transformers static %s: %.1f output tok/s at batch %d",
            name,
            figures["output_throughput"],
            figures["best_batch_size"],
        )
    return out


def _hf_continuous(run: Run, model: Any, loads: dict[str, list[Request]]) -> dict[str, Any]:
    """transformers' continuous batching (`generate_batch`'s manager, one request each with its own
    output length), where this transformers has it."""
    import transformers

    if not hasattr(model, "generate_batch") or not hasattr(model, "init_continuous_batching"):
        return {"status": "absent", "transformers": transformers.__version__}
    kwargs: dict[str, Any] = {"generation_config": _cb_config(model, loads)}
    if run.profile.hf_cb_num_blocks is not None:
        kwargs["continuous_batching_config"] = transformers.ContinuousBatchingConfig(
            num_blocks=run.profile.hf_cb_num_blocks
        )
    manager = model.init_continuous_batching(**kwargs)
    if "max_new_tokens" not in inspect.signature(manager.add_request).parameters:
        return {
            "status": "absent",
            "why": "add_request takes no max_new_tokens",
            "transformers": transformers.__version__,
        }
    t0 = time.perf_counter()
    if run.profile.hf_cb_warmup and hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    out: dict[str, Any] = {"status": "ok", "transformers": transformers.__version__, "workloads": {}}
    try:
        _cb_generate(manager, "warmup", warmup_requests())
        out["warmup_s"] = time.perf_counter() - t0
        for name, requests in loads.items():
            out["workloads"][name] = time_throughput(functools.partial(_cb_generate, manager, name), requests)
            log.info(
                "transformers continuous %s: %.1f output tok/s",
                name,
                out["workloads"][name]["output_throughput"],
            )
    finally:
        manager.stop(block=True)
    return out


def _cb_config(model: Any, loads: dict[str, list[Request]]) -> Any:
    from transformers import GenerationConfig

    longest = max(n for requests in loads.values() for _, n in requests)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # eos_token_id -1: no EOS, every request runs to its own max_new_tokens
    return GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)


def _cb_generate(manager: Any, tag: str, requests: list[Request]) -> int:
    for i, (prompt, num_out) in enumerate(requests):
        manager.add_request(input_ids=prompt, request_id=f"{tag}-{i}", max_new_tokens=num_out)
    produced: dict[str, int] = {}
    while len(produced) < len(requests):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"the continuous batching loop stopped with {len(produced)} done")
            continue
        if _is_finished(result):
            if getattr(result, "error", None):
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            produced[result.request_id] = len(result.generated_tokens)
    return sum(produced.values())


def _is_finished(result: Any) -> bool:
    if callable(getattr(result, "is_finished", None)):
        return bool(result.is_finished())
    return str(getattr(result, "status", "")).upper().endswith("FINISHED")


def ratios(systems: dict[str, Any]) -> dict[str, float]:
    """Corral's output tok/s over each baseline's, per workload."""
    out: dict[str, float] = {}
    corral = systems.get("corral", {}).get("workloads", {})
    for base in ("hf-static", "hf-cb"):
        theirs = systems.get(base, {}).get("workloads", {})
        for name in WORKLOADS:
            if name in corral and name in theirs:
                out[f"{name}_corral_over_{base}"] = (
                    corral[name]["output_throughput"] / theirs[name]["output_throughput"]
                )
    return out
