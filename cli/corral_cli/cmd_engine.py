"""`corral engine --model URI`: serve a checkpoint with the bundled engine behind the OpenAI API.

Engine flags are derived from the option declarations in corral_engine.args (EngineArgs.to_cli_args
renders them back, the operator relies on that) and default to None so EngineArgs' own defaults apply.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from corral_engine.args import (
    DEFAULTS,
    OPTIONS,
    RULES,
    ArgumentError,
    EngineArgs,
    Exclusive,
    cli_flag,
    default_text,
    is_list,
    parse_bytes,
    value_type,
)
from corral_engine.chat_template import load_chat_template
from corral_engine.lora import AdapterRegistry, startup_adapters
from corral_engine.settings import EngineSettings
from corral_engine.sources import FetchError
from pydantic import ValidationError

from corral_cli import cmd_fetch_model, malloc, termination, tracing
from corral_cli.flags import port_number
from corral_cli.heap import freeze_startup_heap
from corral_cli.listen import cannot_listen

if TYPE_CHECKING:
    from corral_engine.server.engine_client import EngineClient

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8100
DEFAULT_DRAIN_TIMEOUT_S = 20.0
# How OpenMP workers wait between parallel regions; read once, when torch loads its OpenMP. They
# spin briefly (GOMP_SPINCOUNT: libgomp counts ~100,000 spins a millisecond, so ~0.1 ms) so that one
# step's ops run back to back, then sleep, so the server's event loop and anything else on the node
# get the cores between steps (a spinning team whose other thread is descheduled stalls every op).
# PASSIVE alone (sleep at once) cost batch-1 decode 25 -> 16 ms a token and batched W2 12-16%
# (docs/engine-speed.md, item 13); other OpenMP runtimes ignore GOMP_SPINCOUNT and sleep.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="URI", help=OPTIONS["model"].help)
    cmd_fetch_model.add_source_arguments(parser, cache_flag="--model-cache-dir")
    _add_server_arguments(parser)
    _add_engine_arguments(parser)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per engine option, derived from its declaration in corral_engine.args."""
    groups: dict[str, Any] = {}  # option -> its mutually exclusive group
    for rule in RULES:
        if isinstance(rule, Exclusive):
            groups[rule.first] = groups[rule.second] = parser.add_mutually_exclusive_group()
    for name, option in OPTIONS.items():
        if name == "model":
            continue
        target = groups.get(name, parser)
        help_text = f"{option.help} (default: {default_text(name)})"
        if value_type(name) is bool:
            # A bool flag says "not the default": --no-prefix-caching turns prefix caching off.
            action = "store_false" if DEFAULTS[name] else "store_true"
            switch = "turn off" if DEFAULTS[name] else "turn on"
            help_text = f"{switch}: {option.help}"
            target.add_argument(cli_flag(name), dest=name, action=action, default=None, help=help_text)
            continue
        target.add_argument(
            cli_flag(name),
            dest=name,
            type=_flag_type(name),
            choices=option.choices,
            metavar=option.metavar,
            nargs="+" if is_list(name) else None,  # --lora-modules a=/x b=/y
            help=help_text,
        )


def _flag_type(name: str) -> Callable[[str], object]:
    return _byte_size if OPTIONS[name].is_bytes else value_type(name)


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})"
    )
    parser.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CORRAL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
        "(default: $CORRAL_API_KEY, else none)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help=f"on SIGTERM, time running requests get to finish (default: {DEFAULT_DRAIN_TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--log-probe-requests",
        action="store_true",
        help="write access lines for successful GET/HEAD /health, /metrics and /v1/models too "
        "(default: only their failures; probes, scrapes and the gateway repeat them all day)",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="with --enable-lora, serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(default: only when $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, as in vLLM)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/HTTP here, e.g. http://127.0.0.1:4318 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing)",
    )
    parser.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="serve a simulated engine instead of the model: the real scheduler and server, step times "
        "from PROFILE (h100-llama3-8b, h100-llama3-70b, a100-llama3-8b, a100-llama3-70b, "
        "h100-llama3-8b-corral, h100-bge-large (an embedding model: --runner pooling), or a fitted "
        "profile's JSON file); --model gives only the tokenizer (and config.json with --runner "
        "pooling); no torch (docs/simulator.md)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --simulate: serve this many replicas from this one process, on consecutive ports "
        "from --port (default: 1)",
    )
    parser.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="throughput log period (default: 10)",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; flags not given keep EngineArgs' defaults."""
    given = {name: getattr(ns, name) for name in OPTIONS if getattr(ns, name, None) is not None}
    return EngineArgs(**given)


def lora_registry(engine_args: EngineArgs) -> AdapterRegistry | None:
    """The adapters the server lists and names with --enable-lora (the engine core registers the
    same ones, with the same ids, from the same arguments); None without it."""
    if not engine_args.enable_lora:
        return None
    return AdapterRegistry(startup_adapters(engine_args.lora_modules))


def _with_local_model(args: argparse.Namespace, engine_args: EngineArgs) -> EngineArgs:
    """EngineArgs naming the local checkpoint the URI resolves to (downloaded into the cache first
    when it is not complete there), served under the URI's name unless one was given."""
    resolved = cmd_fetch_model.fetch(args.model, cache_dir=args.model_cache_dir, s3_endpoint=args.s3_endpoint)
    if resolved.uri.scheme == "local":
        return engine_args
    name = engine_args.served_model_name or resolved.uri.default_served_name
    return dataclasses.replace(engine_args, model=str(resolved.path), served_model_name=name)


def _set_torch_threads(num_threads: int | None, num_ranks: int = 1, in_this_process: bool = True) -> None:
    """OpenMP's and the allocator's environment (a core process started later inherits it, and
    sets its threads itself), then this process's torch threads when the model runs here."""
    for name, value in OPENMP_DEFAULTS.items():  # unless the user set them
        os.environ.setdefault(name, value)
    # Weights, KV cache and large activations on 2 MiB pages (corral_cli.malloc); read by PyTorch
    # at its first allocation, so before the import.
    os.environ.setdefault(malloc.THP_ENV, "1")
    if not in_this_process:
        return
    import torch

    # Tensor-parallel ranks on one machine share its cores.
    torch.set_num_threads(num_threads or max(1, len(os.sched_getaffinity(0)) // num_ranks))
    # The step loop is the only caller, so extra inter-op pools just contend; setting it fails
    # (RuntimeError) once parallel work has started, which is harmless.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def _log_memory_setup(device: str) -> None:
    """On CPU, which allocator the engine runs on and whether tensors get huge pages (device chosen
    by the engine's own rule)."""
    from corral_engine.errors import ModelLoadError
    from corral_engine.model.device import select_device

    try:
        is_cpu = select_device(device).type == "cpu"
    except ModelLoadError:
        return  # the engine reports the bad device when it loads
    if is_cpu:
        level, message = malloc.advice(malloc.is_loaded(), malloc.find_tcmalloc())
        log.log(level, "%s", message)
        level, message = malloc.huge_pages_advice(os.environ.get(malloc.THP_ENV), malloc.thp_mode())
        log.log(level, "%s", message)


def run(args: argparse.Namespace) -> int:
    """Serve until shut down; a start-up failure's reason also goes to the termination message."""
    last = termination.LastError()
    log.addHandler(last)
    try:
        code = _run(args)
    except Exception as e:  # a bug's traceback goes to the log as ever; its one line goes here too
        termination.write(f"{type(e).__name__}: {e}")
        raise
    finally:
        log.removeHandler(last)
    if code:
        termination.write(last.message or f"the engine exited with code {code}")
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        engine_args = engine_args_from(args)
    except ArgumentError as e:
        log.error("%s", e)
        return 2
    problem = cannot_listen(args.host, range(args.port, args.port + max(args.replicas, 1)))
    if problem is not None:  # said now, not after minutes of loading the model
        log.error("%s", problem)
        return 1
    try:  # before the simulated branch too: a simulated fleet's spans read as an engine's
        tracing.configure("corral-engine", args.otlp_traces_endpoint)
    except tracing.TracingUnavailable as e:
        log.error("%s", e)
        return 2
    if args.simulate is not None:
        from corral_cli.simulate import run_simulated

        return run_simulated(args, engine_args)
    if args.replicas != 1:
        log.error("--replicas is for --simulate; run one engine process per replica")
        return 2
    try:  # a bad template is said now, not after minutes of loading the model
        chat_template = load_chat_template(engine_args.chat_template)
    except ArgumentError as e:
        log.error("%s", e)
        return 2
    try:
        settings = EngineSettings()  # the CORRAL_* switches, read here once
    except ValidationError as e:
        log.error("invalid engine setting in the environment: %s", e)
        return 2
    try:
        engine_args = _with_local_model(args, engine_args)
    except FetchError as e:
        log.error("cannot fetch the model: %s", e.one_line())
        return e.exit_code
    in_own_process = _engine_in_own_process(settings, engine_args.device)
    # The core's process inherits the environment these set; this one then never imports torch.
    _set_torch_threads(engine_args.num_threads, engine_args.tensor_parallel_size, not in_own_process)
    if not in_own_process:
        _log_memory_setup(engine_args.device)

    from corral_engine.errors import ModelLoadError
    from corral_engine.server import create_app
    from corral_engine.server.lifecycle import serve

    where = "a process of its own" if in_own_process else "this process"
    log.info("loading %s (engine core in %s)", engine_args.model, where)
    engine: EngineClient
    try:
        engine = _start_engine(engine_args, settings, in_own_process)
    except ModelLoadError as e:
        log.error("cannot load the model: %s", e)
        return 1
    except RuntimeError as e:  # the engine core's process failed to start
        log.error("%s", e)
        return 1
    app = create_app(
        engine,
        api_key=args.api_key,
        log_interval_s=args.log_interval,
        tool_call_parser=engine_args.tool_call_parser,
        chat_template=chat_template,
        reasoning_parser=engine_args.reasoning_parser,
        log_probe_requests=args.log_probe_requests,
        adapters=lora_registry(engine_args),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating or settings.allow_runtime_lora_updating,
    )
    freeze_startup_heap()
    serve(app.state.ctx, app, args.host, args.port, args.drain_timeout)
    return 0


def _start_engine(args: EngineArgs, settings: EngineSettings, in_own_process: bool) -> EngineClient:
    """The engine front, its engine loaded: the core in a process of its own, or on a thread of
    this one. Either way a replica that loses a tensor-parallel rank or its core exits."""
    if in_own_process:
        from corral_engine.engine_core import EngineCoreClient

        client = EngineCoreClient(args, settings=settings)
        client.on_core_exit = _exit_after_core_exit
        return client
    from corral_engine.async_engine import AsyncEngine

    engine = AsyncEngine(args, settings=settings)
    if hasattr(engine.engine.runner, "on_failure"):  # tensor parallel
        engine.engine.runner.on_failure = _exit_on_rank_failure
    return engine


def _engine_in_own_process(settings: EngineSettings, device: str) -> bool:
    """CORRAL_ENGINE_PROCESS: 1 or 0 as set; auto: on CUDA (a device named outright decides without
    importing torch; `auto` asks it whether CUDA is there)."""
    if settings.engine_process != "auto":
        return settings.engine_process == "1"
    if device != "auto":
        return device.startswith("cuda")
    from corral_engine.errors import ModelLoadError
    from corral_engine.model.device import select_device

    try:
        return select_device(device).type == "cuda"
    except ModelLoadError:
        return False  # the engine reports the bad device when it loads


def _exit_after_core_exit(reason: str) -> None:
    """The engine core's process died (a dead tensor-parallel rank ends it, or the kernel killed
    it): the open streams have their errors; give the event loop a moment to send them, then exit
    with an error like a one-process engine whose rank died."""
    time.sleep(0.5)
    _exit_on_rank_failure(reason)


def _exit_on_rank_failure(message: str) -> None:
    """A tensor-parallel rank died (the others are stopped already): the replica cannot serve, so
    it exits at once with an error, for its supervisor (Kubernetes, `corral up`) to restart."""
    log.error("%s; exiting", message)
    termination.write(message)
    logging.shutdown()
    os._exit(1)
