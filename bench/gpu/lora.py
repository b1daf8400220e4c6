"""The GPU run's `lora` phase: greedy equality of a batch mixing two adapters and the base model,
and what LoRA costs a decode step (no LoRA, --enable-lora with base-model requests, 4 adapters).

Equality runs in float32 on the tiny checkpoint, as the equality phase does (it has no bf16
tolerance to borrow): the engine on the run's device against the same engine on CPU, and against
transformers + peft on the run's device where peft imports (the GPU image has it; nothing carried).
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from corral_engine.args import EngineArgs
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.llm_engine import LLMEngine
from corral_engine.lora import CONFIG_FILE, WEIGHTS_FILE, LoraRequest, startup_adapters
from corral_engine.sampling_params import SamplingParams

from bench.gpu import measure, reference
from bench.gpu.context import Run, free_memory

log = logging.getLogger("gpu")

# (adapter name, write_demo_adapter options): one on every target, one on three at another rank.
EQUALITY_ADAPTERS: dict[str, dict[str, Any]] = {
    "all7": {"rank": 8, "seed": 1},
    "qvd": {"rank": 4, "alpha": 8.0, "seed": 2, "targets": ("q_proj", "v_proj", "down_proj")},
}
SPEED_RANK = 16
SPEED_NUM_ADAPTERS = 4


def lora(run: Run, results: dict[str, Any]) -> dict[str, Any]:
    out = {"equality": _equality(run), "speed": _speed(run)}
    out["passed"] = out["equality"]["passed"]
    return out


def _adapter(run: Run, model_dir: Path, name: str, **options: Any) -> Path:
    """A demo adapter for `model_dir`, written once per models_dir."""
    path = run.models_dir / "adapters" / f"{model_dir.name}-{name}"
    if not ((path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file()):
        write_demo_adapter(model_dir, path, **options)
    return path


def _generate(
    engine: LLMEngine, prompts: list[list[int]], loras: list[LoraRequest | None], new_tokens: int, tag: str
) -> list[list[int]]:
    """All prompts at once, each with its adapter (None: the base model); greedy tokens in order."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, (prompt, lora_request) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, params, lora=lora_request)
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = list(o.outputs[0].token_ids)
    return [final[f"{tag}-{i}"] for i in range(len(prompts))]


def _equality(run: Run) -> dict[str, Any]:
    p = run.profile
    model_dir = run.model_dir("tiny")
    paths = {name: _adapter(run, model_dir, name, **options) for name, options in EQUALITY_ADAPTERS.items()}
    modules = tuple(f"{name}={path}" for name, path in paths.items())
    by_name = {lora.name: lora for lora in startup_adapters(modules)}
    kinds: list[str | None] = [*paths, None]  # each prompt's adapter in turn, then the base model
    prompts = reference.random_prompts(max(p.equality_prompts, len(kinds)), 500, seed=22)
    names = [kinds[i % len(kinds)] for i in range(len(prompts))]
    loras = [None if n is None else by_name[n] for n in names]
    options = {**run.equality_options(), "enable_lora": True, "lora_modules": modules, "max_loras": 2}
    engine, record = run.engine(model_dir, **options)
    got = _generate(engine, prompts, loras, p.equality_new_tokens, "equality")
    run.release()
    references: dict[str, Any] = {}
    cpu = LLMEngine(EngineArgs(model=str(model_dir), device="cpu", **options))
    references["engine-cpu"] = _compare(got, _generate(cpu, prompts, loras, p.equality_new_tokens, "cpu"))
    del cpu
    references["peft"] = _peft(run, model_dir, paths, prompts, names, got)
    passed = all(r.get("num_equal") == len(prompts) for r in references.values() if "error" not in r)
    log.info("lora equality: %s", {k: v.get("num_equal", v.get("error")) for k, v in references.items()})
    return {
        "passed": passed and any("error" not in r for r in references.values()),
        "device": str(run.device),
        "dtype": "float32",
        "engine": record,
        "num_prompts": len(prompts),
        "new_tokens": p.equality_new_tokens,
        "adapters": [n or "base" for n in names],
        "references": references,
    }


def _compare(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    diverged = [reference.first_divergence(g, w) for g, w in zip(got, want, strict=True)]
    return {"num_equal": sum(d is None for d in diverged), "first_divergence": diverged}


def _peft(
    run: Run,
    model_dir: Path,
    paths: dict[str, Path],
    prompts: list[list[int]],
    names: list[str | None],
    got: list[list[int]],
) -> dict[str, Any]:
    """transformers + peft on the run's device, each prompt alone; an error here is a figure, not
    the phase's end (the CPU engine's comparison still stands)."""
    try:
        from peft import PeftModel
    except ImportError:
        return {"error": "peft is not installed here"}
    try:
        want: list[list[int] | None] = [None] * len(prompts)
        for name in dict.fromkeys(names):
            model = reference.load_model(model_dir, run.device, torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, str(paths[name])).eval()
            idx = [i for i, n in enumerate(names) if n == name]
            tokens = reference.transformers_greedy(
                model, [prompts[i] for i in idx], run.profile.equality_new_tokens
            )
            for i, t in zip(idx, tokens, strict=True):
                want[i] = t
            del model
            free_memory(run.device)
        return {**_compare(got, [w or [] for w in want]), "peft": importlib.metadata.version("peft")}
    except Exception as e:  # a reference that cannot run is reported, not fatal
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


def _speed(run: Run) -> dict[str, Any]:
    """Decode step time at each batch of `overhead_batches`: no LoRA (the engine's default GPU
    path, graphs included), the LoRA engine with base-model requests, and 4 adapters round-robin."""
    p = run.profile
    model_dir = run.model_dir(p.batch1_preset)
    paths = [
        _adapter(run, model_dir, f"r{SPEED_RANK}-{i}", rank=SPEED_RANK, seed=i + 1)
        for i in range(SPEED_NUM_ADAPTERS)
    ]
    modules = tuple(f"s{i}={path}" for i, path in enumerate(paths))
    loras = startup_adapters(modules)
    lora_options = {"enable_lora": True, "lora_modules": modules, "max_loras": 4, "max_lora_rank": SPEED_RANK}
    arms: list[tuple[str, dict[str, Any], list[LoraRequest]]] = [
        ("no-lora", {}, []),
        ("lora-base", lora_options, []),
        ("lora-4", lora_options, loras),
    ]
    out: dict[str, Any] = {"preset": p.batch1_preset, "dtype": p.dtype, "rank": SPEED_RANK, "arms": {}}
    for name, options, arm_loras in arms:
        engine, record = run.engine(model_dir, **run.speed_options(), **options)
        batches = {str(b): _step_ms(run, engine, b, arm_loras, name) for b in p.overhead_batches}
        out["arms"][name] = {"engine": record, "batches": batches}
        log.info("lora %s: %s", name, {b: round(v["step_ms"], 3) for b, v in batches.items()})
    run.release()
    base = out["arms"]["no-lora"]["batches"]
    out["ratios"] = {
        b: {
            f"{arm.replace('-', '_')}_over_no_lora": out["arms"][arm]["batches"][b]["step_ms"]
            / base[b]["step_ms"]
            for arm in ("lora-base", "lora-4")
        }
        for b in base
    }
    return out


def _step_ms(run: Run, engine: LLMEngine, batch: int, loras: list[LoraRequest], tag: str) -> dict[str, Any]:
    """Mean decode step time of `batch` requests (all past their prompts), adapters round-robin."""
    p = run.profile
    params = SamplingParams(max_tokens=p.lora_steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (7 * i + j) % 900 for j in range(p.overhead_prompt_len)]
        engine.add_request(
            f"{tag}-{batch}-{i}", prompt, params, lora=loras[i % len(loras)] if loras else None
        )
    while any(s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.live_sequences()):
        engine.step()
    for _ in range(3):  # first-call costs, adapters into their slots
        engine.step()
    measure.sync(run.device)
    t0 = time.perf_counter()
    for _ in range(p.lora_steps):
        engine.step()
    measure.sync(run.device)
    step_s = (time.perf_counter() - t0) / p.lora_steps
    rows = len(engine.last_schedule)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return {"step_ms": 1000 * step_s, "num_steps": p.lora_steps, "rows_last_step": rows}
