"""The GPU run's `int4` phase: an AWQ int4 checkpoint (`corral demo-model --quantization awq`, the
same random weights as the bf16 one) through PyTorch's int4 kernel (tinygemm on CUDA).

Agreement: greedy tokens of the int4-kernel engine against the same engine with the layers
dequantized at load (CORRAL_INT4_KERNEL=0: only the matmul differs), both bf16; `num_equal` and the
share before the first difference. Speed: the mean decode step at batch 1 and 64 for the bf16
checkpoint and the AWQ one, and the model's allocated GiB both ways. Runs on CPU too (--smoke).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from corral_engine.demo_model import write_demo_model
from corral_engine.sampling_params import SamplingParams

from bench.gpu import reference
from bench.gpu.context import Run
from bench.gpu.quant import _guarded, _module_gib, _step_s, agreement

log = logging.getLogger("gpu")


def int4(run: Run, results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["agreement"] = _guarded(lambda: _agreement(run))
    out["speed"] = _guarded(lambda: _speed(run))
    return out


def awq_dir(run: Run, preset: str) -> Path:
    """The AWQ twin of `preset`'s checkpoint (the same seed and device), written once."""
    plain = run.model_dir(preset)
    path = plain.with_name(plain.name + "-awq")
    marker = path.with_name(path.name + ".complete")
    if marker.is_file():
        return path
    shutil.rmtree(path, ignore_errors=True)
    device = "cpu" if preset == "tiny" else run.profile.device
    t0 = time.perf_counter()
    write_demo_model(path, preset=preset, device=device, quantization="awq")
    log.info("wrote %s in %.1f s", path.name, time.perf_counter() - t0)
    marker.write_text(preset)
    return path


def _agreement(run: Run) -> dict[str, Any]:
    p = run.profile
    model_dir = awq_dir(run, p.quant_preset)
    prompts = reference.random_prompts(p.quant_prompts, 500, seed=97)
    params = SamplingParams(max_tokens=p.quant_new_tokens, temperature=0.0, ignore_eos=True)
    tokens = {}
    for arm, switch in (("int4", "auto"), ("dequantized", "0")):
        os.environ["CORRAL_INT4_KERNEL"] = switch  # the engine's settings read it at start
        try:
            # int4_arm is no engine option (dropped, listed in the record): it keeps the two engines apart
            engine, record = run.engine(model_dir, dtype="bfloat16", num_kv_blocks=256, int4_arm=arm)
            tokens[arm] = ([list(o.outputs[0].token_ids) for o in engine.generate(prompts, params)], record)
        finally:
            os.environ.pop("CORRAL_INT4_KERNEL", None)
            run.release()
    out = {
        "preset": p.quant_preset,
        "reference": "the same engine, bf16, with the int4 layers dequantized at load",
        "num_prompts": len(prompts),
        "new_tokens": p.quant_new_tokens,
        "engine": tokens["int4"][1],
        **agreement(tokens["int4"][0], tokens["dequantized"][0], p.quant_new_tokens),
    }
    log.info("int4 agreement with its dequantized self: %s", out)
    return out


def _speed(run: Run) -> dict[str, Any]:
    p = run.profile
    arms: dict[str, Any] = {}
    for arm, model_dir in (("bf16", run.model_dir(p.batch1_preset)), ("awq", awq_dir(run, p.batch1_preset))):
        options = {**run.speed_options(), "dtype": "bfloat16"}
        engine, record = run.engine(model_dir, **options)
        figures: dict[str, Any] = {
            "engine": record,
            "weights_gib_allocated": _module_gib(engine),
            "batches": {},
        }
        for batch in p.overhead_batches:
            step_s, context = _step_s(run, engine, batch)
            figures["batches"][str(batch)] = {"step_ms": 1000 * step_s, "mean_context_len": context}
        arms[arm] = figures
        log.info("int4 %s: %s", arm, {b: round(v["step_ms"], 3) for b, v in figures["batches"].items()})
        del engine
        run.release()
    return {
        "preset": p.batch1_preset,
        "arms": arms,
        "awq_over_bf16_step": {
            b: arms["awq"]["batches"][b]["step_ms"] / arms["bf16"]["batches"][b]["step_ms"]
            for b in arms["bf16"]["batches"]
        },
    }
