"""`corral up`: a local fleet on this machine - N engine processes and a gateway in front of them.

Engines run as `corral engine` subprocesses on free 127.0.0.1 ports; the gateway runs in this
process. Ctrl-C or SIGTERM drains the gateway as a pod's SIGTERM does (open requests get
--drain-timeout, then end with a `draining` error), then stops every engine (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from corral_engine.model_args import DEFAULT_GPU_MEMORY_UTILIZATION
from corral_engine.sources import FetchError, local_model_problem, parse_model_uri

from corral_cli import tracing
from corral_cli.cmd_fetch_model import fetch
from corral_cli.flags import non_negative_float, port_number
from corral_cli.heap import freeze_startup_heap
from corral_cli.listen import cannot_listen
from corral_cli.local_adapters import AdapterFetchError, adapter_flags
from corral_cli.local_engines import DEFAULT_DRAIN_TIMEOUT_S, LocalEngine, LogDir, stop_engines, wait_ready
from corral_cli.up_banner import fleet_kind, usage_text

if TYPE_CHECKING:
    from corral_operator.local import LocalFleet

logger = logging.getLogger(__name__)

DEFAULT_DEMO_DIR = Path.home() / ".cache" / "corral" / "demo-model"
DEFAULT_REPLICAS = 2
# After the engines' own drain (--drain-timeout, as the gateway's): their graceful close, then SIGKILL.


class _Stop(Exception):
    """SIGTERM while engines start up."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        metavar="URI",
        help="checkpoint to serve: a directory, hf://ORG/NAME[@REV], s3://BUCKET/PREFIX (fetched once "
        "into the model cache first; docs/models.md)",
    )
    source.add_argument("--demo", action="store_true", help="serve a generated demo model (the default)")
    source.add_argument(
        "-f",
        "--file",
        type=Path,
        metavar="LLMDEPLOYMENT.yaml",
        help="run the LLMDeployment(s) in this file as local processes (same YAML as on a cluster)",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="with -f: the checkpoint directory to serve, in place of the file's model source "
        "(needed for a PVC source)",
    )
    parser.add_argument(
        "--demo-preset", choices=("tiny", "small"), default=None, help="demo model size (default: tiny)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help=f"engine processes (default: {DEFAULT_REPLICAS}; not with -f)",
    )
    parser.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="simulated replicas instead (h100-llama3-8b, ... or a fitted profile's JSON): all of them in "
        "one process, no torch; the tokenizer is --model's, else a demo one with no weights "
        "(docs/simulator.md)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default: 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="gateway port (default: 8000)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients ask for (not with -f: the file names it)",
    )
    parser.add_argument(
        "--policy",
        choices=("prefix-affinity", "kv-aware", "least-requests", "round-robin", "llm-d"),
        default="prefix-affinity",
        help="gateway routing policy (default: prefix-affinity)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, time open requests get to finish before they end with a "
        f"'draining' error; the engines get the same (default: {DEFAULT_DRAIN_TIMEOUT_S:.0f}; a second "
        "Ctrl-C stops at once)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the engines' logs here (default: a temporary directory, removed when the fleet "
        "stops cleanly and kept, with its path logged, when something failed)",
    )


def _model_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """The checkpoint directory and its default served name (the demo model's is 'demo')."""
    if args.model is not None:
        uri = parse_model_uri(args.model)
        if args.simulate is not None and uri.scheme == "local":  # a tokenizer will do: no config.json needed
            return Path(args.model), uri.default_served_name
        # Once here, with the progress on this terminal, rather than in every engine process.
        resolved = fetch(args.model)
        return resolved.path, resolved.uri.default_served_name
    # Simulated replicas read only the tokenizer and config: no weights (207 MB for small) for them.
    has_weights = args.simulate is None
    name = "demo-model" if has_weights else "demo-tokenizer"
    preset = args.demo_preset or "tiny"
    demo_dir = DEFAULT_DEMO_DIR.with_name(name if preset == "tiny" else f"{name}-small")
    if not (demo_dir / "config.json").exists():
        what = "model" if has_weights else "tokenizer"
        logger.info("writing the %s demo %s to %s (once)", preset, what, demo_dir)
        _write_demo_model(demo_dir, preset, has_weights)
    return demo_dir, "demo"


def _write_demo_model(demo_dir: Path, preset: str, has_weights: bool) -> None:
    """`corral demo-model` in a child process: torch and transformers stay out of this one, which
    serves the gateway for as long as the fleet runs (their memory, and the native libraries'
    leak reports at exit, which triton prints once it has been imported)."""
    cmd = [sys.executable, "-m", "corral_cli.main", "demo-model", str(demo_dir), "--preset", preset]
    if not has_weights:
        cmd.append("--no-weights")
    if subprocess.run(cmd, check=False).returncode != 0:
        raise RuntimeError(f"writing the demo model to {demo_dir} failed (the lines above say why)")


def _fleet(args: argparse.Namespace) -> dict[str, list[list[str]]]:
    """Served model name -> one `corral engine` flag list per replica."""
    return _share_the_card(_fleet_flags(args))


def _check_model_dirs(fleet: dict[str, list[list[str]]], *, is_from_file: bool) -> None:
    """Refuse a local model directory that is not one (a simulated replica reads only a tokenizer):
    said now, not once every engine has loaded torch (an hf:// or s3:// model of `-f` is fetched by
    the engines themselves)."""
    for replicas in fleet.values():
        for flags in replicas:
            if "--model" not in flags:
                continue
            model = flags[flags.index("--model") + 1]
            if parse_model_uri(model).scheme != "local":
                continue
            problem = local_model_problem(
                Path(model), "tokenizer.json" if "--simulate" in flags else "config.json"
            )
            if problem is not None:
                hint = " (--model-path DIR serves another in its place)" if is_from_file else ""
                raise FetchError("not_found", f"{problem}{hint}")


def _share_the_card(fleet: dict[str, list[list[str]]]) -> dict[str, list[list[str]]]:
    """Engines that share a GPU (a local fleet's all land on the first) each get an even part of
    the default --gpu-memory-utilization, unless their flags set one: the fraction is per engine,
    and the second at 0.9 would find the card full. Ignored on CPU."""
    num_engines = sum(len(replicas) for replicas in fleet.values())
    if num_engines < 2:
        return fleet
    share = max(0.05, int(DEFAULT_GPU_MEMORY_UTILIZATION / num_engines * 1000) / 1000)
    return {
        name: [
            flags
            if any(f.startswith("--gpu-memory-utilization") for f in flags)
            else [*flags, "--gpu-memory-utilization", str(share)]
            for flags in replicas
        ]
        for name, replicas in fleet.items()
    }


def _served_names(args: argparse.Namespace) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(namespace, LLMDeployment, served name, aliases) of each LLMDeployment in `-f FILE`: on a
    cluster the gateway reads these from the LLMDeployments; locally `_route_aliases` hands them over."""
    if args.file is None:
        return []
    from corral_operator.local import local_fleets

    fleets = local_fleets(Path(args.file).read_text(), model_path=args.model_path)
    return [(f.namespace, f.name, f.served_model_name, f.aliases) for f in fleets]


def _route_aliases(app: Any, served: list[tuple[str, str, str, tuple[str, ...]]]) -> None:
    """Give the gateway the names the LLMDeployments serve, so spec.model.aliases route (and are
    listed) as on a cluster, where Kubernetes discovery brings the same `Naming`."""
    if not any(aliases for *_, aliases in served):
        return
    from corral_gateway.k8s_discovery import Discovery
    from corral_gateway.k8s_names import Served, naming

    names = naming(Served(ns, deployment, name, aliases) for ns, deployment, name, aliases in served)
    app.api.state.fleet.apply_discovery(Discovery(pools={}, owners={}, names=names))


def _replicas(args: argparse.Namespace) -> int:
    return DEFAULT_REPLICAS if args.replicas is None else int(args.replicas)


def _fleet_flags(args: argparse.Namespace) -> dict[str, list[list[str]]]:
    if args.file is not None and args.simulate is not None:
        raise ValueError("--simulate runs the demo model's fleet; it does not combine with -f")
    if args.simulate is not None:
        from corral_engine.sim.perf_model import load_profile

        load_profile(args.simulate)  # a bad name or file is said now, not by the engine it would start
    if args.file is not None:
        # The file says these, as on a cluster; a flag quietly overruled by it would mislead.
        for flag, value in (("--replicas", args.replicas), ("--served-model-name", args.served_model_name)):
            if value is not None:
                raise ValueError(f"{flag} does not combine with -f: the LLMDeployment in the file sets it")
    elif args.model_path is not None:
        raise ValueError("--model-path is for -f (a PVC model source's checkpoint directory)")
    if args.demo_preset is not None and (args.file is not None or args.model is not None):
        raise ValueError("--demo-preset picks the demo model's size; it does not combine with -f or --model")
    if args.file is not None:
        from corral_operator.local import local_fleets

        fleets = local_fleets(Path(args.file).read_text(), model_path=args.model_path)
        out: dict[str, list[list[str]]] = {}
        for f in fleets:
            if f.engine_kind != "corral":
                raise ValueError(f"{f.name}: engine kind {f.engine_kind!r} cannot run locally; use 'corral'")
            # As a pod's command line: the engine arguments (with --served-model-name), where the
            # model comes from, the LoRA flags, then extraArgs.
            flags = [*f.engine_args.to_cli_args(), *model_source_flags(f), *adapter_flags(f), *f.extra_args]
            out.setdefault(f.served_model_name, []).extend([list(flags) for _ in range(f.replicas)])
        return out
    if _replicas(args) < 1:
        raise ValueError("--replicas must be at least 1")
    model_dir, default_name = _model_dir(args)
    name = args.served_model_name or default_name
    flags = ["--model", str(model_dir), "--served-model-name", name]
    if args.simulate is not None:  # one process serves every replica
        return {name: [[*flags, "--simulate", args.simulate]]}
    return {name: [list(flags) for _ in range(_replicas(args))]}


def model_source_flags(fleet: LocalFleet) -> list[str]:
    """`--s3-endpoint` where the file's model is on S3 behind spec.model.s3Endpoint: each engine
    fetches the model itself, from where a pod's init container would."""
    if fleet.s3_endpoint and fleet.engine_args.model.startswith("s3://"):
        return ["--s3-endpoint", fleet.s3_endpoint]
    return []


def _gateway_server(app: Any, host: str, port: int) -> Any:
    """The gateway's `DrainingServer`, as `corral gateway` runs it: the first Ctrl-C or SIGTERM
    drains (new requests 503, open ones get the app's drain timeout, then an error event), a
    second one stops at once."""
    import uvicorn
    from corral_engine.http_limits import uvicorn_options
    from corral_gateway.drain import GRACEFUL_CLOSE_S, DrainingServer

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        log_config=None,  # uvicorn's lines in the process's format (--log-format)
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,  # after the drain: the ended answers' last bytes
        **uvicorn_options(),  # a bound on each request's headers
    )
    return DrainingServer(config, app.drain)


async def _serve_gateway(app: Any, host: str, port: int, banner: str) -> None:
    server = _gateway_server(app, host, port)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        sys.stdout.write(banner)
        sys.stdout.flush()
    await task


def run(args: argparse.Namespace) -> int:
    for noisy in ("aiohttp.access",):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    engines: list[LocalEngine] = []
    log_dir = LogDir(args.log_dir)
    status = 1
    try:
        status = _run_fleet(args, engines, log_dir)
        return status
    finally:
        signal.signal(signal.SIGTERM, previous)
        if engines:
            logger.info("stopping %d engine process%s", len(engines), "es"[: 2 * (len(engines) != 1)])
        stop_engines(engines, args.drain_timeout)
        log_dir.close(has_failed=status != 0 or not all(e.has_stopped_cleanly() for e in engines))


def _run_fleet(args: argparse.Namespace, engines: list[LocalEngine], log_dir: LogDir) -> int:
    """Start the engines (appended to `engines`, which the caller stops), then serve the gateway
    until Ctrl-C or SIGTERM; the exit status."""
    try:
        fleet = _fleet(args)
        _check_model_dirs(fleet, is_from_file=args.file is not None)
        problem = cannot_listen(args.host, [args.port])
        if problem is not None:  # said now, not once every engine has loaded its model
            raise ValueError(f"the gateway {problem}")
        log_path = log_dir.create()
        num_threads = max(1, len(os.sched_getaffinity(0)) // sum(len(f) for f in fleet.values()))
        backends: dict[str, list[str]] = {}
        log_flags = ["--log-level", str(args.log_level), "--log-format", str(args.log_format)]
        for name, replicas in fleet.items():
            for flags in replicas:
                num_replicas = _replicas(args) if args.simulate is not None else 1
                engines.append(
                    LocalEngine(flags, num_threads, log_path, log_flags, num_replicas, args.drain_timeout)
                )
                backends.setdefault(name, []).extend(engines[-1].urls)
        logger.info(
            "starting %d engine process%s (logs in %s%s)",
            len(engines),
            "es"[: 2 * (len(engines) != 1)],
            log_path,
            "" if args.log_dir else ", removed at a clean stop",
        )
        wait_ready(engines)
        name = next(iter(fleet))

        from corral_gateway.app import create_app
        from corral_gateway.settings import GatewaySettings

        settings = GatewaySettings(
            host=args.host,
            port=args.port,
            policy=args.policy,
            backends=backends,
            drain_timeout_s=args.drain_timeout,
        )
        # Traces only from the OTEL_* variables here; the engines, its children, read the same ones.
        tracing.configure("corral-gateway", None)
        base_url = f"http://{args.host}:{args.port}"
        app = create_app(settings)
        _route_aliases(app, _served_names(args))
        freeze_startup_heap()
        # The gateway's server handles SIGINT/SIGTERM from here on: it stops serving and returns.
        asyncio.run(
            _serve_gateway(app, args.host, args.port, usage_text(base_url, name, fleet_kind(fleet[name][0])))
        )
        return 0
    except (KeyboardInterrupt, _Stop):
        return 0
    except (RuntimeError, ValueError, OSError) as e:  # TracingUnavailable is a RuntimeError
        logger.error("%s", e)
        return 1
    except FetchError as e:
        what = "an adapter" if isinstance(e, AdapterFetchError) else "the model"
        logger.error("cannot fetch %s: %s", what, e.one_line())
        return e.exit_code
