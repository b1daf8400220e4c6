"""`corral demo-model DIR`: write a random-weight Hugging Face checkpoint with a local tokenizer."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)

# Kept in step with corral_engine.demo_model (not imported here: the engine side pulls in torch).
_PRESETS = ("tiny", "small", "llama3-8b")
_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3-moe")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument(
        "--preset",
        choices=_PRESETS,
        default="tiny",
        help=(
            "tiny: for tests (hidden 64, 2 layers); small: ~107M-parameter Llama for benchmarks; "
            "llama3-8b: Llama-3-8B's shapes (16 GB in bf16, sharded) for GPU benchmarks"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and tokenizer (default: 0)")
    parser.add_argument(
        "--arch",
        choices=_ARCHS,
        default="llama",
        help="model architecture; mixtral and qwen3-moe: 4 experts, 2 per token, tiny and small presets "
        "only (default: llama)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the weights are drawn: cuda makes llama3-8b quick; each kind of device draws its "
        "own bytes (default: cpu)",
    )
    parser.add_argument(
        "--no-weights",
        action="store_true",
        help="the tokenizer and config only, in seconds and without torch: what `--simulate` reads",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    from corral_engine.demo_model import write_demo_model

    try:
        out = write_demo_model(
            args.dir,
            preset=args.preset,
            seed=args.seed,
            arch=args.arch,
            progress=not args.quiet,
            device=args.device,
            weights=not args.no_weights,
        )
    except OSError as e:  # a file in the way, no permission, a full disk
        log.error("cannot write the checkpoint to %s: %s", args.dir, e)
        return 1
    except ValueError as e:  # a preset without that architecture (llama3-8b has no experts)
        log.error("%s", e)
        return 2
    what = "tokenizer and config" if args.no_weights else "checkpoint"
    log.info("wrote %s %s (%s, seed %d) to %s", args.preset, what, args.arch, args.seed, out)
    return 0
