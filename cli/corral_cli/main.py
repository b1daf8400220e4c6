"""Dispatch `corral SUBCOMMAND`; each subcommand module is imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, one-line help). Modules expose add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("corral_cli.cmd_engine", "serve a model with the bundled engine (OpenAI API)"),
    "gateway": ("corral_cli.cmd_gateway", "run the OpenAI-compatible gateway in front of engines"),
    "operator": ("corral_cli.cmd_operator", "run the Kubernetes operator for LLMDeployments"),
    "up": ("corral_cli.cmd_up", "run a local fleet: engines and a gateway on this machine"),
    "bench": ("corral_cli.cmd_bench", "benchmark an OpenAI-compatible endpoint"),
    "demo-model": ("corral_cli.cmd_demo_model", "write a random-weight HF checkpoint"),
    "calibrate": ("corral_cli.cmd_calibrate", "time the engine's steps and fit a simulator profile"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corral", description="Run fleets of LLMs on Kubernetes.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if e.name != module_name:
                    raise
                continue
            module.add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the chosen subcommand's module (e.g. `corral gateway` must not import torch).
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(only=chosen or "").parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
