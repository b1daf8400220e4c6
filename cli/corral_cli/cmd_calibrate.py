"""`corral calibrate --model DIR --out PROFILE.json`: time the bundled engine's own steps on this
machine and fit the simulator's step-time model to them (`corral engine --simulate PROFILE.json`).

Batches of 1-32 sequences with prompts of 16-512 tokens run to completion; every step's shape
(tokens, sequences, KV read, attention pairs) and wall time are recorded (with async scheduling, on
CUDA, a call's time is the batch it waited for: corral_engine.step_clock), the first steps of each
batch dropped as warm-up, and a non-negative linear model fitted (corral_engine.sim.perf_model.Fitted).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from corral_cli.flags import checked, positive_int

if TYPE_CHECKING:
    from corral_engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

BATCHES = ((1, 16), (1, 256), (4, 64), (8, 128), (16, 32), (32, 16), (2, 512), (16, 256), (32, 64))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint the engine runs")
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument("--device", default="cpu", help="engine device (default: cpu)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="engine dtype: auto, bfloat16, float16 or float32 (default: auto, as `corral engine` picks it)",
    )
    parser.add_argument(
        "--output-tokens",
        type=checked(int, "an integer >= 2", lambda v: v >= 2),  # a step after the first token
        default=24,
        help="tokens generated per sequence",
    )
    parser.add_argument("--repeats", type=positive_int, default=2, help="times each batch shape runs")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts' random token ids")


def run(args: argparse.Namespace) -> int:
    from corral_engine.args import EngineArgs
    from corral_engine.llm_engine import LLMEngine
    from corral_engine.sampling_params import SamplingParams
    from corral_engine.sim.perf_model import Fitted, Profile, StepShape
    from corral_engine.step_clock import StepClock

    from corral_cli.cmd_engine import _set_torch_threads

    try:  # now, not after the minutes of timing that would then be lost
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.out.is_dir():
            raise IsADirectoryError("it is a directory; --out names the profile's file")
    except OSError as e:
        log.error("cannot write %s: %s", args.out, e)
        return 1
    from corral_engine.errors import ModelLoadError
    from corral_engine.options import ArgumentError

    try:
        engine_args = EngineArgs(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=64)
    except ArgumentError as e:
        log.error("%s", e)
        return 2
    _set_torch_threads(engine_args.num_threads)  # as `corral engine` runs it
    try:
        engine = LLMEngine(engine_args)
    except (ModelLoadError, RuntimeError) as e:  # RuntimeError: torch's, e.g. CUDA without a GPU
        log.error("cannot load the model: %s", e)
        return 1
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0.0)
    shapes: list[StepShape] = []
    times_s: list[float] = []
    for repeat in range(args.repeats):
        for num_seqs, prompt_len in BATCHES:
            prompt_len = min(prompt_len, engine.max_model_len - args.output_tokens - 1)
            for i in range(num_seqs):
                prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
                engine.add_request(f"cal-{repeat}-{num_seqs}-{prompt_len}-{i}", prompt, params)
            step_index = 0
            clock = StepClock()
            while engine.has_unfinished_requests():
                started = time.perf_counter()
                engine.step()
                elapsed_s = time.perf_counter() - started
                # With async scheduling (CUDA) a call's time is the batch launched the call before.
                timed = clock.record(engine.last_schedule, elapsed_s, engine.step_in_flight)
                if timed is None:
                    continue
                # The first steps warm caches up; a call that waited for two batches fits neither.
                if step_index >= 2 and len(timed.schedules) == 1:
                    shapes.append(StepShape.of(timed.schedules[0]))
                    times_s.append(timed.seconds)
                step_index += 1
        log.info("calibration pass %d: %d steps timed", repeat + 1, len(times_s))
    model = Fitted.fit(shapes, times_s)
    # Steps another process slowed down (a shared machine) are outliers, not the engine: refit
    # without the steps more than 3x the median error off, once.
    errors = [abs(model.step_time_s(s) - t) / t for s, t in zip(shapes, times_s, strict=True)]
    limit = 3 * statistics.median(errors)
    kept = [(s, t) for s, t, e in zip(shapes, times_s, errors, strict=True) if e <= limit]
    model = Fitted.fit([s for s, _ in kept], [t for _, t in kept])
    errors = [abs(model.step_time_s(s) - t) / t for s, t in kept]
    log.info(
        "fit on %d of %d steps: coefficients %s, median error %.1f%%",
        len(kept), len(shapes), model.coefficients, 100 * statistics.median(errors),
    )  # fmt: skip
    name = f"{args.device}-{Path(args.model).name}"
    profile = Profile(
        name,
        model,
        num_kv_blocks=engine.block_manager.num_blocks,
        max_num_seqs=engine_args.max_num_seqs,
        max_num_batched_tokens=engine_args.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        block_size=engine_args.block_size,
        kv_bytes_per_token=_kv_bytes_per_token(engine),
    )
    report = profile.to_json() | {"median_fit_error": statistics.median(errors), "num_steps": len(times_s)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s", args.out)
    return 0


def _kv_bytes_per_token(engine: LLMEngine) -> int:
    """K and V bytes one token takes in the engine's cache on one rank (what the engine divides
    --kv-cache-memory by), so `--simulate PROFILE --kv-cache-memory` sizes blocks as it would."""
    from corral_engine.model.runner import ModelRunner
    from corral_engine.model.tp_workers import ParallelRunner

    runner = engine.runner
    local = runner.local if isinstance(runner, ParallelRunner) else runner
    if not isinstance(local, ModelRunner):  # an encoder: no KV cache
        return 0
    return sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in local.kv_caches)  # [blocks, block, heads, dim]
