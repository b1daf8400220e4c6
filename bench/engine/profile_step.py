"""Where one Corral decode step's time goes at batch 64: torch.profiler top ops and cProfile's Python view.

    .venv/bin/python bench/engine/profile_step.py [--batch 64] [--prompt-len 128] [--steps 10] \
        [--device cuda] [--overlap auto|1|0] [--async-scheduling auto|1|0]

`--overlap 0` and `--overlap 1` (two runs, two --out-dir) A/B the output overlap;
`--async-scheduling` the same for async scheduling.

Fills the batch (64 x 128-token prompts), steps until every sequence is decoding, then profiles
`--steps` decode steps. Writes profile.md (tables) and a Chrome trace to --out-dir. The requests
are greedy unless `--temperature` (and `--top-p`) say otherwise: `--temperature 1.0 --top-p 0.9`
profiles a sampled batch, as OpenAI traffic is (temperature 1.0 is its default).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import time
from pathlib import Path

import torch
from corral_engine.args import EngineArgs
from corral_engine.llm_engine import LLMEngine
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

log = logging.getLogger("profile_step")
MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="every request's (0: greedy; OpenAI's default is 1)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (with --temperature > 0)")
    p.add_argument(
        "--workload",
        type=Path,
        help="take the batch's prompts from this token-id JSONL (e.g. W2's mixed lengths)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="engine device (cuda: the GPU path, CUDA graphs on)")
    p.add_argument(
        "--overlap",
        choices=["auto", "1", "0"],
        default="auto",
        help="CORRAL_OVERLAP_OUTPUT: a step's text work during the next step's device work (auto: on CUDA)",
    )
    p.add_argument(
        "--async-scheduling",
        choices=["auto", "1", "0"],
        default="auto",
        help="CORRAL_ASYNC_SCHEDULING: the next step launched before this one's tokens return (auto: CUDA)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", help="float32 shows the non-matmul costs on CPUs without bf16"
    )
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/profile"))
    return p.parse_args()


def fill_batch(engine: LLMEngine, prompts: list[list[int]], steps: int, sampling: SamplingParams) -> None:
    """Add the requests and step until none is prefilling (all are in single-token decode)."""
    # Long enough that no sequence finishes before the profiled steps (filling W2's 200 prompts
    # alone takes ~25 steps, and each profiled step runs three times: plain, torch, cProfile).
    params = sampling.replace(max_tokens=4 * steps + 256, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    while any(s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.live_sequences()):
        engine.step()
    for _ in range(3):  # a few decode steps so first-call costs are paid
        engine.step()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(
        EngineArgs(
            model=str(args.model),
            dtype=args.dtype,
            num_threads=args.threads,
            device=args.device,
            max_num_seqs=args.batch,
            max_num_batched_tokens=2048,
        ),
        EngineSettings(overlap_output=args.overlap, async_scheduling=args.async_scheduling),
    )
    if args.workload is not None:
        lines = args.workload.read_text().splitlines()[: args.batch]
        prompts = [list(json.loads(line)["prompt"]) for line in lines]
    else:
        vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
        prompts = [[1 + (i * 7 + j) % (vocab - 1) for j in range(args.prompt_len)] for i in range(args.batch)]
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    fill_batch(engine, prompts, args.steps, sampling)
    lens = sorted(len(p) for p in prompts)
    batch = len(engine.live_sequences())

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    plain_ms = 1000 * (time.perf_counter() - t0) / args.steps

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("engine.step"):
                engine.step()
    prof.export_chrome_trace(str(args.out_dir / "decode-step-trace.json"))
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48)

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(30)
    own = io.StringIO()
    pstats.Stats(profiler, stream=own).sort_stats("tottime").print_stats(25)

    how = "greedy" if sampling.is_greedy else f"temperature {args.temperature}, top_p {args.top_p}"
    text = (
        f"# Corral decode step profile: batch {batch} ({how}), prompt lengths {lens[0]}..{lens[-1]} "
        f"(median {lens[len(lens) // 2]}), "
        f"{args.steps} steps, {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.device}, output overlap {'on' if engine.overlaps_output else 'off'}, "
        f"async scheduling {'on' if engine.schedules_ahead else 'off'}\n\n"
        f"Mean step time without a profiler: {plain_ms:.2f} ms "
        f"({1000 * batch / plain_ms:.0f} output tok/s at this batch)\n\n"
        f"## torch.profiler, ops by self CPU time ({args.steps} steps)\n\n```\n{ops}\n```\n\n"
        f"## cProfile, by cumulative time ({args.steps} steps)\n\n```\n{buf.getvalue()}\n```\n\n"
        f"## cProfile, by own time ({args.steps} steps)\n\n```\n{own.getvalue()}\n```\n"
    )
    (args.out_dir / "profile.md").write_text(text)
    log.info("mean decode step %.2f ms at batch %d; wrote %s", plain_ms, batch, args.out_dir / "profile.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
