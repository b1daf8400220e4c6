"""`corral engine --model DIR`: serve a checkpoint with the bundled engine behind the OpenAI API.

Engine flags mirror EngineArgs field by field (EngineArgs.to_cli_args renders them, the operator
relies on that), and default to None so EngineArgs' own defaults apply.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re

from corral_engine.args import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DTYPES,
    KV_POLICIES,
    ArgumentError,
    EngineArgs,
)
from corral_engine.settings import EngineSettings
from pydantic import ValidationError

from corral_cli import malloc

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8100
DEFAULT_DRAIN_TIMEOUT_S = 20.0
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `2G`, `1.5gi` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512MiB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="Hugging Face checkpoint directory")
    _add_server_arguments(parser)
    _add_engine_arguments(parser)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name", metavar="NAME", help="model name in the API (default: DIR's name)"
    )
    parser.add_argument("--dtype", choices=DTYPES, help="weights and KV dtype (default: auto)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--block-size", type=int, help=f"tokens per KV block (default: {DEFAULT_BLOCK_SIZE})")
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV-cache size in blocks")
    kv.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        metavar="BYTES",
        dest="kv_cache_memory_bytes",
        help=f"KV-cache size in bytes, e.g. 512MiB (default: {DEFAULT_KV_CACHE_MEMORY_BYTES >> 20}MiB)",
    )
    parser.add_argument(
        "--max-model-len", type=int, metavar="N", help="context window (default: the model's)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, metavar="N", help=f"sequences per step (default: {DEFAULT_MAX_NUM_SEQS})"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help=f"token budget per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument("--kv-policy", choices=KV_POLICIES, help="on KV pressure (default: preempt)")
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="turn prefix caching off",
    )
    parser.add_argument(
        "--max-waiting", type=int, metavar="N", help="waiting requests before 429s (default: unbounded)"
    )
    parser.add_argument("--seed", type=int, help="engine seed for unseeded sampling (default: 0)")
    parser.add_argument("--num-threads", type=int, metavar="N", help="torch CPU threads (default: all cores)")
    parser.add_argument(
        "--speculative", choices=("ngram",), help="speculative decoding for greedy requests (default: off)"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="draft tokens per step when speculating (default: 4)",
    )
    parser.add_argument(
        "--prompt-lookup-min",
        type=int,
        metavar="N",
        help="shortest recurring n-gram that proposes drafts (default: 2)",
    )
    parser.add_argument(
        "--prompt-lookup-max", type=int, metavar="N", help="longest n-gram, tried first (default: 3)"
    )


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CORRAL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $CORRAL_API_KEY, else none)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help=f"on SIGTERM, time running requests get to finish (default: {DEFAULT_DRAIN_TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="throughput log period (default: 10)",
    )


_ENGINE_FIELDS = (
    "model",
    "served_model_name",
    "dtype",
    "device",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_policy",
    "enable_prefix_caching",
    "max_waiting",
    "seed",
    "num_threads",
    "speculative",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; flags not given keep EngineArgs' defaults."""
    given = {name: getattr(ns, name) for name in _ENGINE_FIELDS if getattr(ns, name, None) is not None}
    return EngineArgs(**given)


def _set_torch_threads(num_threads: int | None) -> None:
    # OpenMP workers sleep instead of spinning between parallel regions (unless the user chose a
    # policy): the server's event loop, and anything else on the node, shares these cores, and a
    # spinning team whose other thread is descheduled stalls every op. Read once, at torch import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Weights, KV cache and large activations on 2 MiB pages (corral_cli.malloc); read by PyTorch
    # at its first allocation, so before the import.
    os.environ.setdefault(malloc.THP_ENV, "1")
    import torch

    torch.set_num_threads(num_threads or max(1, len(os.sched_getaffinity(0))))
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
    try:
        engine_args = engine_args_from(args)
    except ArgumentError as e:
        log.error("%s", e)
        return 2
    try:
        settings = EngineSettings()  # the CORRAL_* switches, read here once
    except ValidationError as e:
        log.error("invalid engine setting in the environment: %s", e)
        return 2
    _set_torch_threads(engine_args.num_threads)
    _log_memory_setup(engine_args.device)

    from corral_engine.async_engine import AsyncEngine
    from corral_engine.errors import ModelLoadError
    from corral_engine.server import create_app
    from corral_engine.server.lifecycle import serve

    log.info("loading %s", engine_args.model)
    try:
        engine = AsyncEngine(engine_args, settings=settings)
    except ModelLoadError as e:
        log.error("cannot load the model: %s", e)
        return 1
    app = create_app(engine, api_key=args.api_key, log_interval_s=args.log_interval)
    serve(app.state.ctx, app, args.host, args.port, args.drain_timeout)
    return 0
