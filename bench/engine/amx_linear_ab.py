"""Corral's AMX Linear kernel (kernels/amx_linear.c) against oneDNN's packed bf16 matmul, in one
process, on a CPU with AMX tiles.

    .venv/bin/python bench/engine/amx_linear_ab.py [--batch 8] [--prompt-len 250] [--output-len 1] \\
        [--rounds 10]

One offline engine on the small demo checkpoint in bf16, built with oneDNN's packed weights
(CORRAL_AMX_LINEAR=0); each layer the AMX kernel fits is then packed for it too, and every round
generates the same greedy batch twice, through either, the order flipping every round so a
drifting machine favours neither. `--output-len 1` times prompt steps (8 x 250 = one 2,000-token
step), a longer output with a large `--batch` mostly decode steps. Prints, and writes to
--out-dir/amx_linear_ab.json (with the lscpu model and flags) and amx_linear_ab.png, the median
seconds a run per side, the per-round ratios (oneDNN / AMX) and how many sequences' tokens are
identical (both sum the same products in float32; the order differs in a few outputs, so
near-ties of a random-weight model may flip).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from ab_rounds import alternate_rounds
from corral_engine.args import EngineArgs
from corral_engine.llm_engine import LLMEngine
from corral_engine.model.llama import Linear
from corral_engine.model.native import load_amx_linear
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings
from lora_ab import cpu_info

MODEL_DIR = Path.home() / ".cache" / "corral-bench" / "model-small"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=250)
    p.add_argument("--output-len", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/amx-linear-ab"))
    return p.parse_args()


def main() -> int:
    args = parse_args()
    settings = EngineSettings(amx_linear="0", small_batch_kernel="1")  # plain weights kept: packable
    kernel = load_amx_linear(EngineSettings())
    if kernel is None:
        raise SystemExit("no AMX tiles on this CPU (or no C compiler): nothing to compare")
    engine = LLMEngine(
        EngineArgs(
            model=str(args.model),
            dtype="bfloat16",
            num_threads=args.threads,
            max_num_seqs=max(args.batch, 1),
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,  # every run computes its prompts
        ),
        settings,
    )
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    amx_layers = [m for m in linears if m.weight.numel() and m.prepack_amx(kernel, keep_weight=True)]
    if not amx_layers:
        raise SystemExit("the AMX kernel takes none of this model's Linear layers")

    def use_amx(on: bool) -> None:
        for linear in amx_layers:
            linear.amx = kernel if on else None

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    seconds, tokens = alternate_rounds(engine, prompts, params, use_amx, ("onednn", "amx"), args.rounds)
    ratios = [a / b for a, b in zip(seconds["onednn"], seconds["amx"], strict=True)]
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "layers_on_amx": f"{len(amx_layers)} of {len(linears)}",
        "seconds_median": {k: statistics.median(v) for k, v in seconds.items()},
        "ratios_onednn_over_amx": ratios,
        "median_ratio": statistics.median(ratios),
        "identical_sequences": sum(a == b for a, b in zip(tokens["onednn"], tokens["amx"], strict=True)),
        "cpu": cpu_info(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "amx_linear_ab.json").write_text(json.dumps(result, indent=2))
    plot(result, seconds, args.out_dir / "amx_linear_ab.png")
    summary = {k: v for k, v in result.items() if k not in ("args", "cpu")}
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def plot(result: dict[str, Any], seconds: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(seconds)
    left.bar(names, [statistics.median(seconds[n]) for n in names], color=["#7f7f7f", "#1f77b4"])
    for i, n in enumerate(names):  # each round, to show the spread
        left.plot([i] * len(seconds[n]), seconds[n], "k.", markersize=4)
    left.set_title("seconds per run (median, rounds as dots)", fontsize=9)
    ratios = result["ratios_onednn_over_amx"]
    right.plot(range(1, len(ratios) + 1), ratios, "o-")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_title("oneDNN / AMX per round (> 1: AMX faster)", fontsize=9)
    right.set_xlabel("round")
    a = result["args"]
    fig.suptitle(
        f"AMX Linear vs oneDNN: batch {a['batch']} x {a['prompt_len']} in / {a['output_len']} out, "
        f"{result['cpu']['model_name']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
