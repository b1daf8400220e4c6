"""The GPU run's `quant` phase: what `--quantization fp8` does on a GPU with FP8 tensor cores.

Four parts, each reported on its own (one that fails leaves the others): agreement of the fp8
engine's greedy tokens with a float32 CPU reference whose projections went through fp8 and back (a
share, not pass/fail: the engine also quantizes activations and accumulates in other orders), the
decode step at batch 1 and 64 in bf16 and fp8 (CUDA events, MBU), the weights' GiB both ways, and
W2's offline throughput both ways while the phase's time budget lasts. Skipped, with a note, where
there is no CUDA, the GPU is older than sm 8.9, or the engine has no --quantization.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from corral_engine.demo_model import MOE_ARCHITECTURES, build_config_dict, count_parameters
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams

from bench.engine.worker_common import Request, time_throughput, warmup_requests
from bench.gpu import measure, reference
from bench.gpu.context import Run, engine_fields
from bench.gpu.throughput import workload_requests

log = logging.getLogger("gpu")

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores (torch._scaled_mm)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARMS: dict[str, dict[str, Any]] = {"bf16": {}, "fp8": {"quantization": "fp8"}}
_GIB = 1 << 30


def quant(run: Run, results: dict[str, Any]) -> dict[str, Any]:
    p = run.profile
    config = build_config_dict(p.batch1_preset)  # no checkpoint written for a run that skips
    out: dict[str, Any] = {"preset": p.batch1_preset, "weights_gib": weight_gib(config)}
    capability = torch.cuda.get_device_capability(run.device) if run.device.type == "cuda" else None
    skipped = skip_reason(run.device.type, capability, engine_fields())
    if skipped is not None:
        log.info("quant: skipped: %s", skipped)
        return {**out, "skipped": skipped}
    t0 = time.perf_counter()
    out["agreement"] = _guarded(lambda: _agreement(run))
    out["speed"] = _guarded(lambda: _speed(run, config, results, t0))
    return out


def skip_reason(device_type: str, capability: tuple[int, int] | None, fields: Iterable[str]) -> str | None:
    """Why this run cannot measure fp8, or None when it can."""
    if device_type != "cuda" or capability is None:
        return f"no CUDA device (device {device_type}): fp8 matmuls need a GPU of sm >= 8.9"
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} < 8.9: no FP8 tensor cores"
    if "quantization" not in set(fields):
        return "this engine's EngineArgs has no quantization option"
    return None


def projection_params(config: dict[str, Any]) -> int:
    """Parameters --quantization stores at 1 byte: the layers' attention projections, and their MLP
    projections unless the model is a mixture of experts (its experts stay in the model dtype)."""
    h = int(config["hidden_size"])
    n_heads, n_kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or h // n_heads)
    q, kv = n_heads * head_dim, n_kv * head_dim
    per_layer = 2 * h * q + 2 * h * kv
    if config["architectures"][0] not in MOE_ARCHITECTURES:
        per_layer += 3 * h * int(config["intermediate_size"])
    return int(config["num_hidden_layers"]) * per_layer


def weight_gib(config: dict[str, Any], itemsize: int = 2) -> dict[str, float]:
    """The weights' GiB in the model dtype and with the projections at 1 byte (embeddings, lm_head,
    norms and biases stay at `itemsize`), from the config alone."""
    total, projections = count_parameters(config), projection_params(config)
    return {
        "bf16": total * itemsize / _GIB,
        "fp8": ((total - projections) * itemsize + projections) / _GIB,
        "projection_share": projections / total,
    }


def decode_bytes(config: dict[str, Any], is_fp8: bool, batch: int, context_len: float) -> float:
    """Bytes one decode step of `batch` sequences reads: the weights once (as
    measure.decode_bytes_per_token counts them; fp8 projections at 1 byte), and K and V (bf16) of
    every sequence's context."""
    figures = measure.decode_bytes_per_token(config, 2, context_len)
    weights = figures["weight_bytes"] - (projection_params(config) if is_fp8 else 0)
    return weights + batch * context_len * figures["kv_bytes_per_context_token"]


def fp8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] through float8 e4m3 with a scale per output row, back in its dtype."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [out, 1]
    return ((weight / scale).to(torch.float8_e4m3fn).to(weight.dtype) * scale).to(weight.dtype)


def cpu_reference(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, is_fp8: bool
) -> list[list[int]]:
    """Greedy tokens of transformers in float32 on CPU; with `is_fp8`, each projection's weight
    rounded through fp8 first."""
    model = reference.load_model(model_dir, torch.device("cpu"), torch.float32)
    if is_fp8:
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
                    module.weight.copy_(fp8_round_trip(module.weight))
    return reference.transformers_greedy(model, prompts, new_tokens)


def agreement(got: list[list[int]], want: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """How far each prompt's tokens agree before they first differ, as a share of `new_tokens`."""
    diverged = [reference.first_divergence(g, w) for g, w in zip(got, want, strict=True)]
    agreed = [new_tokens if d is None else min(d, new_tokens) for d in diverged]
    return {
        "num_equal": sum(d is None for d in diverged),
        "first_divergence": diverged,
        "share": sum(agreed) / (new_tokens * len(agreed)) if agreed else None,
    }


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # a part that fails is a figure; the phase's other parts still run
        log.exception("quant part failed")
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


def _agreement(run: Run) -> dict[str, Any]:
    """Each arm's greedy tokens on the run's device against its float32 CPU reference: the bf16
    arm's share is the baseline the fp8 arm's is read against (bf16 alone drifts from float32)."""
    p = run.profile
    model_dir = run.model_dir(p.quant_preset)
    prompts = reference.random_prompts(p.quant_prompts, 500, seed=89)
    params = SamplingParams(max_tokens=p.quant_new_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {
        "preset": p.quant_preset,
        "reference": "transformers, float32, CPU; for fp8, projections through fp8 e4m3 (a scale per "
        "output row)",
        "num_prompts": len(prompts),
        "new_tokens": p.quant_new_tokens,
    }
    for name, options in ARMS.items():
        engine, record = run.engine(model_dir, dtype=p.dtype, num_kv_blocks=256, **options)
        got = [list(o.outputs[0].token_ids) for o in engine.generate(prompts, params)]
        del engine
        run.release()
        want = cpu_reference(model_dir, prompts, p.quant_new_tokens, is_fp8=name == "fp8")
        out[name] = {"engine": record, **agreement(got, want, p.quant_new_tokens)}
        log.info("quant agreement of %s with its float32 reference: %s", name, out[name])
    return out


def _speed(run: Run, config: dict[str, Any], results: dict[str, Any], t0: float) -> dict[str, Any]:
    """Per arm: decode step times at each batch, MBU, the engine's weights and KV blocks, and W2's
    throughput while the phase's budget lasts."""
    p = run.profile
    model_dir = run.model_dir(p.batch1_preset)
    read_gb_s = results.get("bandwidth", {}).get("read_gb_s_median")
    arms: dict[str, Any] = {}
    for name, options in ARMS.items():
        engine, record = run.engine(model_dir, **run.speed_options(), **options)
        arm: dict[str, Any] = {"engine": record, "weights_gib_allocated": _module_gib(engine), "batches": {}}
        for batch in p.overhead_batches:
            step_s, context = _step_s(run, engine, batch)
            figures = {"step_ms": 1000 * step_s, "mean_context_len": context}
            achieved = decode_bytes(config, name == "fp8", batch, context) / step_s / 1e9
            figures["achieved_gb_s"] = achieved
            if read_gb_s:
                figures["mbu_ratio"] = achieved / read_gb_s
            arm["batches"][str(batch)] = figures
        if p.quant_budget_s is None or time.perf_counter() - t0 < p.quant_budget_s:
            arm["w2"] = _w2(engine, model_dir, p.quick_workloads)
        arms[name] = arm
        log.info("quant %s: %s", name, {b: round(v["step_ms"], 3) for b, v in arm["batches"].items()})
        del engine
        run.release()
    out: dict[str, Any] = {"preset": p.batch1_preset, "arms": arms}
    out["fp8_over_bf16_step"] = {
        b: arms["fp8"]["batches"][b]["step_ms"] / arms["bf16"]["batches"][b]["step_ms"]
        for b in arms["bf16"]["batches"]
    }
    if all("w2" in a for a in arms.values()):
        out["fp8_over_bf16_w2"] = (
            arms["fp8"]["w2"]["output_throughput"] / arms["bf16"]["w2"]["output_throughput"]
        )
    if not read_gb_s:
        out["note"] = "no bandwidth phase in this run: MBU left out"
    return out


def _module_gib(engine: LLMEngine) -> float | None:
    """GiB of the engine's model's parameters and buffers as it holds them (None where the model
    lives in other processes: tensor parallel)."""
    model = getattr(engine.runner, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / _GIB


def _step_s(run: Run, engine: LLMEngine, batch: int) -> tuple[float, float]:
    """Mean decode step of `batch` requests, all past their prompts, between two CUDA events (wall
    time on CPU), and their mean context length over the timed steps."""
    p = run.profile
    params = SamplingParams(max_tokens=p.quant_steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"quant-{batch}-{i}", [100 + (7 * i + j) % 900 for j in range(p.overhead_prompt_len)], params
        )
    while any(s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.live_sequences()):
        engine.step()
    for _ in range(3):  # first-call costs
        engine.step()
    context = p.overhead_prompt_len + 4 + p.quant_steps / 2
    step_s = _timed_steps(run, engine, p.quant_steps)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return step_s, context


def _timed_steps(run: Run, engine: LLMEngine, num_steps: int) -> float:
    """Mean seconds of `num_steps` steps: between two CUDA events (one sync at the end), else wall."""
    if run.device.type != "cuda":
        measure.sync(run.device)
        start_s = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        return (time.perf_counter() - start_s) / num_steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(run.device)
    start.record()
    for _ in range(num_steps):
        engine.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / num_steps


def _w2(engine: LLMEngine, model_dir: Path, quick: bool) -> dict[str, Any]:
    max_len = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    requests, _ = workload_requests("W2", model_dir, max_len, quick)

    def generate(batch: list[Request]) -> int:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in batch]
        return sum(len(o.outputs[0].token_ids) for o in engine.generate([q for q, _ in batch], params))

    generate(warmup_requests())
    return time_throughput(generate, requests)
