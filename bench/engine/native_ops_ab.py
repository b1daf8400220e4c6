"""Native bf16 CPU kernels on and off, in one process: rotary embedding and the residual add with
RMSNorm (`--kernels elementwise`), the small-batch matmul with the native decode stack that runs
small decode batches' whole decoder in one call (`linear`; against PyTorch's emulated bf16 matmul
on AVX2, oneDNN's packed bf16 matmul where bf16 is native), or both (`all`, the default).

    .venv/bin/python bench/engine/native_ops_ab.py [--batch 1] [--rounds 20] [--output-len 48]

One offline engine on the small demo checkpoint in bf16 (the CPU path the kernels serve); each
round generates the same greedy batch twice, once through the kernels and once through the PyTorch
code they replace (`Attention.fused_ops` and `Linear.fused_ops` unset, `RMSNorm.add_forward` as an
add then the norm), the order flipping every round so a drifting machine favours neither.
Separate processes differ by more than the ~1 ms a step the elementwise kernels save (measured:
0.86-1.30x between rounds at batch 1), hence one process. Prints and writes to
--out-dir/native_ops_ab.json the median time a step per side, the per-round ratios (off / on)
and how many sequences' tokens are identical (all of them with the elementwise kernels, which
round as PyTorch does; the matmul sums in another order, so near-ties of a random-weight model
may flip).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import types
from pathlib import Path

import torch
from ab_rounds import alternate_rounds
from corral_engine.args import EngineArgs
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.llama import Attention, Linear, RMSNorm
from corral_engine.model.runner import ModelRunner
from corral_engine.sampling_params import SamplingParams

MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", choices=("all", "elementwise", "linear"), default="all")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/native-ops-ab"))
    return p.parse_args()


def _add_then_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return norm(summed), summed


def main() -> int:
    args = parse_args()
    engine = LLMEngine(
        EngineArgs(
            model=str(args.model),
            dtype="bfloat16",
            num_threads=args.threads,
            max_num_seqs=max(args.batch, 1),
            max_num_batched_tokens=2048,
        )
    )
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # one rank of a decoder
    modules = list(runner.model.modules())
    elementwise = args.kernels in ("all", "elementwise")
    layers = [m for m in modules if isinstance(m, Attention)] if elementwise else []
    norms = [m for m in modules if isinstance(m, RMSNorm)] if elementwise else []
    linears = [m for m in modules if isinstance(m, Linear)] if args.kernels != "elementwise" else []
    kernels = runner.model.model.norm.fused_ops
    if kernels is None:
        raise SystemExit("the native fused ops did not build here (no C compiler?)")
    if linears and linears[0].fused_ops is None:
        raise SystemExit(
            "the Linear layers take no native kernel here: CORRAL_SMALL_BATCH_KERNEL is 0, or the plain "
            "weights it reads did not fit beside the packed ones (CORRAL_SMALL_BATCH_KERNEL=1 keeps them)"
        )
    model = runner.model
    stack = model.decode_stack if linears else None  # the elementwise A/B runs layer by layer

    def use_kernels(on: bool) -> None:
        model.decode_stack = stack if on else None
        for layer in layers:
            layer.fused_ops = kernels if on else None
        for linear in linears:
            linear.fused_ops = kernels if on else None
        for norm in norms:
            if on:
                norm.__dict__.pop("add_forward", None)
            else:
                norm.add_forward = types.MethodType(_add_then_norm, norm)  # type: ignore[method-assign]

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32_000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    seconds, tokens = alternate_rounds(engine, prompts, params, use_kernels, ("off", "on"), args.rounds)
    ratios = [off / on for off, on in zip(seconds["off"], seconds["on"], strict=True)]
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "ms_per_step_median": {k: statistics.median(v) / args.output_len * 1e3 for k, v in seconds.items()},
        "ratios_off_over_on": ratios,
        "median_ratio": statistics.median(ratios),
        "ratio_quartiles": statistics.quantiles(ratios, n=4),
        "identical_sequences": sum(a == b for a, b in zip(tokens["off"], tokens["on"], strict=True)),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "native_ops_ab.json").write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k not in ("args", "ratios_off_over_on")}
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
