"""Dispatch `corral SUBCOMMAND`; each subcommand module is imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from corral_cli import heap, logs

# subcommand -> (module, one-line help, the extra it needs). Modules expose add_arguments(parser)
# and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "engine": ("corral_cli.cmd_engine", "serve a model with the bundled engine (OpenAI API)", "engine"),
    "gateway": ("corral_cli.cmd_gateway", "run the OpenAI-compatible gateway in front of engines", "gateway"),
    "operator": ("corral_cli.cmd_operator", "run the Kubernetes operator for LLMDeployments", "operator"),
    "up": ("corral_cli.cmd_up", "run a local fleet: engines and a gateway on this machine", "engine,gateway"),
    "bench": ("corral_cli.cmd_bench", "benchmark an OpenAI-compatible endpoint", "bench"),
    "fetch-model": (
        "corral_cli.cmd_fetch_model",
        "download a model (hf://, s3://) into the model cache",
        "engine",
    ),
    "check": ("corral_cli.cmd_check", "list an endpoint's models and send one chat completion", "gateway"),
    "run-batch": (
        "corral_cli.cmd_run_batch",
        "run a file of OpenAI batch requests against a server or a local engine",
        "engine",
    ),
    "demo-model": ("corral_cli.cmd_demo_model", "write a random-weight HF checkpoint", "engine"),
    "calibrate": (
        "corral_cli.cmd_calibrate",
        "time the engine's steps and fit a simulator profile",
        "engine",
    ),
}
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_LOG_FORMAT: logs.LogFormat = "text"


def version() -> str:
    """The installed corral distribution's version (also served on the engine's and gateway's /version)."""
    try:
        return importlib.metadata.version("corral")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _global_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """Options every subcommand shares, accepted before or after it. After it, they default to
    SUPPRESS, so a value given before the subcommand is not overwritten by the default."""
    parser.add_argument(
        "--log-level",
        type=str.upper,  # debug works too
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        default=DEFAULT_LOG_LEVEL if defaults else argparse.SUPPRESS,
        help=f"logging level (default: {DEFAULT_LOG_LEVEL})",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.LOG_FORMATS,
        default=DEFAULT_LOG_FORMAT if defaults else argparse.SUPPRESS,
        help=f"text lines, or one JSON object a line with request fields (default: {DEFAULT_LOG_FORMAT})",
    )


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, unless its help already says it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if not has_shown_default(action) or "default" in (action.help or ""):
            return action.help
        return f"{action.help or ''} (default: %(default)s)".lstrip()


def has_shown_default(action: argparse.Action) -> bool:
    """Whether `--help` should show the option's default (flags and "no value" defaults do not)."""
    # By identity: `0 in (False,)` and `1.0 in (True,)` hold, which would hide defaults of 0 and 1.
    default = action.default
    is_shown = default is not None and not isinstance(default, bool) and default is not argparse.SUPPRESS
    return bool(action.option_strings) and is_shown


def _help_for_every_default(parser: argparse.ArgumentParser) -> None:
    """argparse lists an option without help text bare; give those with a default a help line."""
    for action in parser._actions:
        if action.help is None and has_shown_default(action):
            action.help = "(default: %(default)s)"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    formatter = HelpFormatter
    parser = argparse.ArgumentParser(
        prog="corral", description="Run fleets of LLMs on Kubernetes.", formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"corral {version()}")
    _global_options(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text, _) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text, formatter_class=formatter)
        _global_options(sp, defaults=False)
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            _help_for_every_default(sp)
    return parser


def missing_extra_message(command: str, error: ModuleNotFoundError) -> str | None:
    """One line naming the extra to install when a third-party module is missing; None when the
    missing module is Corral's own (a broken install, shown as it is)."""
    missing = (error.name or "").split(".")[0]
    if not missing or missing.startswith("corral"):
        return None
    extras = SUBCOMMANDS[command][2]
    return (
        f"corral {command} needs the Python package {missing!r}, which is not installed: "
        f"pip install 'corral[{extras}]'"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the chosen subcommand's module (e.g. `corral gateway` must not import torch).
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    try:
        args = build_parser(only=chosen or "").parse_args(argv)
        logs.configure(str(args.log_level), args.log_format)
        if args.command in heap.SERVING_COMMANDS:
            heap.serving_thresholds()  # a bad CORRAL_GC_THRESHOLDS stops it before it loads anything
        module = importlib.import_module(SUBCOMMANDS[args.command][0])
        return int(module.run(args) or 0)
    except ModuleNotFoundError as e:
        message = missing_extra_message(chosen, e) if chosen is not None else None
        if message is None:
            raise
        sys.stderr.write(f"corral: error: {message}\n")
        return 1
    except heap.ThresholdSettingError as e:
        sys.stderr.write(f"corral: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
