"""Simulated replicas behind the real engine server: one, or many in one process on one event loop
(`corral engine --simulate`, `corral up --simulate`). Nothing here imports torch or transformers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from corral_engine.errors import ModelLoadError
from corral_engine.http_limits import uvicorn_options
from corral_engine.lora import AdapterRegistry, LoraRequest
from corral_engine.sim.async_engine import AsyncSimEngine
from corral_engine.sim.embedding import SimPooling
from corral_engine.sim.engine import SimEngine
from corral_engine.sim.grammar import SimGrammars
from corral_engine.sim.perf_model import Profile, Roofline, quantized, with_kv_cache_dtype
from corral_engine.sim.tokenizer import LightTokenizer, read_json_object
from corral_engine.sim.vision import SimVision

if TYPE_CHECKING:
    from fastapi import FastAPI

    from corral_engine.server.lifecycle import Drain

logger = logging.getLogger(__name__)

# Engine options a simulated replica honours, by the profile field each overrides.
PROFILE_OPTIONS = ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size")
# Options that size the KV cache from memory. --kv-cache-memory needs a token's KV bytes, which a
# roofline profile works out and a calibrated one records; --gpu-memory-utilization needs the GPUs'
# memory and the weights' size too, which only a roofline profile knows.
KV_MEMORY_OPTIONS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
# Options the profile itself stands for: its step times were modelled or measured for one GPU
# type, tensor-parallel size, dtype and engine configuration, which a replica cannot change.
PROFILE_FIXED_OPTIONS = (
    "tensor_parallel_size",
    "dtype",
    "speculative",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "attention_backend",
    "enforce_eager",
    "device",
)


def with_overrides(profile: Profile, given: Mapping[str, Any]) -> Profile:
    """The profile with the sizing options the user gave (`--max-num-seqs 64`, ...), its KV cache
    sized in the engine's order: --num-kv-blocks; else --kv-cache-memory (bytes per GPU) where the
    profile knows a token's KV bytes; else --gpu-memory-utilization on a roofline profile; else the
    profile's own KV bytes, so --block-size alone changes the block count, not the memory, as it
    does on the engine (raises ValueError when the memory holds no block). A roofline profile is
    first quantized as --quantization says (smaller weights: faster decode, more KV blocks), then
    its KV cache put in --kv-cache-dtype (fp8: half the bytes a token)."""
    if given.get("quantization") is not None and isinstance(profile.model, Roofline):
        profile = quantized(profile, given["quantization"])
    if given.get("kv_cache_dtype") not in (None, "auto") and isinstance(profile.model, Roofline):
        profile = with_kv_cache_dtype(profile, given["kv_cache_dtype"])
    sizes = {k: v for k, v in given.items() if k in PROFILE_OPTIONS and v is not None}
    resized = dataclasses.replace(profile, **sizes)
    if "num_kv_blocks" in sizes:
        return resized
    kv_bytes, utilization = (given.get(k) for k in KV_MEMORY_OPTIONS)
    num_blocks = None if kv_bytes is None else resized.num_kv_blocks_in(kv_bytes)
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(
                f"kv cache memory {kv_bytes} bytes holds no block of {resized.block_size} tokens of "
                f"{profile.name} ({resized.gpu_kv_bytes_per_token()} bytes a token a GPU); raise it"
            )
    elif utilization is not None and isinstance(resized.model, Roofline):
        num_blocks = resized.model.num_kv_blocks(resized.block_size, utilization)
    elif resized.block_size != profile.block_size:
        num_blocks = max(1, profile.num_kv_blocks * profile.block_size // resized.block_size)
    else:
        return resized
    return dataclasses.replace(resized, num_kv_blocks=num_blocks)


def ignored_options(profile: Profile, given: Mapping[str, Any]) -> list[str]:
    """The options given that this profile cannot honour, by field name."""
    ignored = [k for k in PROFILE_FIXED_OPTIONS if given.get(k) is not None]
    if given.get("kv_cache_memory_bytes") is not None and profile.gpu_kv_bytes_per_token() is None:
        ignored.append("kv_cache_memory_bytes")
    if not isinstance(profile.model, Roofline):
        ignored += [k for k in ("gpu_memory_utilization", "quantization") if given.get(k) is not None]
        if given.get("kv_cache_dtype") not in (None, "auto"):
            ignored.append("kv_cache_dtype")
    return ignored


def checkpoint_quantization(model_dir: Path) -> str | None:
    """The weights config.json's quantization_config stores, as a simulated replica costs them:
    fp8 (quant_method fp8, or compressed-tensors with 8-bit float weights), int4 (AWQ, 4-bit GPTQ,
    compressed-tensors with 4-bit int weights), None without one or for 8-bit int weights (the engine
    dequantizes those at load: the model dtype's bytes). ModelLoadError for any other method
    (bitsandbytes, GGUF, ...), which the engine refuses at start-up too; the engine's finer checks
    of a format's variants (model/quant_formats.py) are not repeated here."""
    config = read_json_object(model_dir / "config.json").get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    kinds = _weight_kinds(config) if method == "compressed-tensors" else set()
    bits = config.get("bits") if method == "gptq" else None
    if method == "fp8" or kinds == {("float", 8)}:
        return "fp8"
    if method == "awq" or bits == 4 or kinds == {("int", 4)}:
        return "int4"
    if bits == 8 or kinds == {("int", 8)}:
        return None
    raise ModelLoadError(
        f"{model_dir / 'config.json'}: quantization_config quant_method {method!r} is not supported "
        "(fp8 checkpoints: quant_method fp8, or compressed-tensors with 8-bit float weights; int4 and "
        "int8: awq, gptq, compressed-tensors pack-quantized)"
    )


def _weight_kinds(config: dict[str, Any]) -> set[tuple[Any, Any]]:
    """The (type, num_bits) of the weights of every compressed-tensors config group (empty: none)."""
    groups = config.get("config_groups")
    if not isinstance(groups, dict):
        return set()
    weights = [g.get("weights") if isinstance(g, dict) else None for g in groups.values()]
    return {(w.get("type"), w.get("num_bits")) if isinstance(w, dict) else (None, None) for w in weights}


def eos_token_ids(model_dir: Path, tokenizer: LightTokenizer) -> tuple[int, ...]:
    """config.json's eos_token_id (one id or a list), else the tokenizer's eos token."""
    eos = read_json_object(model_dir / "config.json").get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaSpec:
    profile: Profile
    model_dir: Path
    served_model_name: str
    enable_prefix_caching: bool = True
    kv_policy: str = "preempt"
    max_waiting: int | None = None
    tool_call_parser: str | None = None  # as --tool-call-parser: tool_choice "auto" is read with it
    chat_template: str | None = None  # as --chat-template, read: in place of the tokenizer's
    reasoning_parser: str | None = None  # as --reasoning-parser: reasoning_content is read with it
    stream_interval: int = 1  # as --stream-interval
    kv_cache_dtype: str = "auto"  # as --kv-cache-dtype: the metrics' label (`profile` sized for it)
    max_loras: int = 0  # as --max-loras with --enable-lora; 0: LoRA off
    max_lora_rank: int = 16  # as --max-lora-rank
    adapters: tuple[LoraRequest, ...] = ()  # as --lora-modules (configs checked by the caller)
    allow_runtime_lora_updating: bool = False  # as --allow-runtime-lora-updating
    pooling: SimPooling | None = None  # an embedding model's, as --runner pooling serves it
    vision: SimVision | None = None  # a vision-language model's images and tower (sim/vision.py)


def build_engines(spec: ReplicaSpec, num_replicas: int) -> list[AsyncSimEngine]:
    """`num_replicas` simulated engines sharing one tokenizer."""
    tokenizer = LightTokenizer(spec.model_dir)
    eos = eos_token_ids(spec.model_dir, tokenizer)
    grammars = SimGrammars(tokenizer, tokenizer.vocab_size, eos)
    engines = []
    for _ in range(num_replicas):
        core = SimEngine(
            spec.profile,
            tokenizer,
            spec.served_model_name,
            eos,
            enable_prefix_caching=spec.enable_prefix_caching,
            kv_policy=spec.kv_policy,
            stream_interval=spec.stream_interval,
            grammars=grammars,
            max_loras=spec.max_loras,
            cache_dtype=spec.kv_cache_dtype,
            pooling=spec.pooling,
            vision=spec.vision,
        )
        engines.append(AsyncSimEngine(core, spec.max_waiting, spec.max_lora_rank))
    return engines


def replica_app(engine: AsyncSimEngine, spec: ReplicaSpec, api_key: str | None = None) -> FastAPI:
    """The engine server's app over one simulated replica, configured as `spec` says."""
    from corral_engine.server import create_app

    return create_app(
        engine,
        api_key=api_key,
        log_interval_s=60.0,
        tool_call_parser=spec.tool_call_parser,
        chat_template=spec.chat_template,
        reasoning_parser=spec.reasoning_parser,
        adapters=AdapterRegistry(list(spec.adapters)) if spec.max_loras else None,
        allow_runtime_lora_updating=spec.allow_runtime_lora_updating,
    )


class _FleetServer(uvicorn.Server):
    """One of many servers on one loop: the fleet, not each server, owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_fleet(
    spec: ReplicaSpec,
    host: str,
    ports: list[int],
    api_key: str | None = None,
    on_ready: Callable[[], None] | None = None,
    drain_timeout_s: float = 20.0,
) -> None:
    """Serve one simulated replica per port until SIGINT/SIGTERM, then drain them all as one
    engine drains (`lifecycle.Drain`): 503 to new requests and /health, open ones run to their
    end for up to `drain_timeout_s`; a second signal exits at once."""
    from corral_engine.server.lifecycle import Drain

    loop = asyncio.get_running_loop()
    engines = build_engines(spec, len(ports))
    servers, contexts = [], []
    for engine, port in zip(engines, ports, strict=True):
        app = replica_app(engine, spec, api_key)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=2,
            **uvicorn_options(),
        )
        servers.append(_FleetServer(config))
        contexts.append(app.state.ctx)
    drain = Drain(contexts, drain_timeout_s)
    signalled = _handle_signals(loop, drain, servers)
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.05)
    logger.info(
        "%d simulated replicas (%s) on %s ports %s", len(ports), spec.profile.name, host, _ports_text(ports)
    )
    if on_ready is not None:
        on_ready()
    watch = asyncio.create_task(_watch_lag(engines))
    signal_wait = asyncio.create_task(signalled.wait())
    await asyncio.wait([signal_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
    signal_wait.cancel()
    while drain.is_begun and not servers[0].force_exit and not any(t.done() for t in tasks):
        if drain.poll():
            break
        await asyncio.sleep(0.1)  # uvicorn's own tick
    watch.cancel()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)


def _handle_signals(
    loop: asyncio.AbstractEventLoop, drain: Drain, servers: list[_FleetServer]
) -> asyncio.Event:
    """SIGINT and SIGTERM: the first begins the drain (the event is set), a second exits at once
    (as `lifecycle.DrainingServer` handles them for one engine)."""
    signalled = asyncio.Event()

    def on_signal(sig: int) -> None:
        if drain.is_begun:
            logger.warning("second signal %d: exiting now", sig)
            for s in servers:
                s.should_exit = s.force_exit = True
            return
        drain.begin(sig)
        signalled.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return signalled


async def _watch_lag(
    engines: list[AsyncSimEngine], interval_s: float = 10.0, max_lag_s: float = 0.05
) -> None:
    """Warn when steps end later than the profile says: the process cannot keep up (too many
    replicas or tokens per second for its CPU), so latencies read high and throughput low."""
    while True:
        await asyncio.sleep(interval_s)
        lag_s = max(e.max_lag_s for e in engines)
        for e in engines:
            e.max_lag_s = 0.0
        if lag_s > max_lag_s:
            logger.warning(
                "simulated steps ended up to %.0f ms after their predicted time in the last %.0f s: "
                "this process cannot keep up; run fewer replicas per process",
                1000 * lag_s,
                interval_s,
            )


def _ports_text(ports: list[int]) -> str:
    return f"{ports[0]}-{ports[-1]}" if ports == list(range(ports[0], ports[0] + len(ports))) else str(ports)
