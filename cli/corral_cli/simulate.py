"""`corral engine --simulate PROFILE`: simulated replicas behind the engine's server, without torch."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
from pathlib import Path
from typing import Any

from corral_engine.args import OPTIONS, EngineArgs, cli_flag
from corral_engine.chat_template import load_chat_template
from corral_engine.engine_setup import check_vision_args
from corral_engine.errors import ModelLoadError
from corral_engine.lora import read_adapter_config, startup_adapters
from corral_engine.settings import EngineSettings
from corral_engine.sim.embedding import sim_pooling
from corral_engine.sim.host import (
    ReplicaSpec,
    build_engines,
    checkpoint_quantization,
    ignored_options,
    serve_fleet,
    with_overrides,
)
from corral_engine.sim.perf_model import Profile, describe, load_profile
from corral_engine.sim.vision import SimVision, sim_vision
from corral_engine.sim.vision_cost import Grid, QwenTowerShape, TowerShape, vision_cost
from corral_engine.sources.uri import parse_model_uri

from corral_cli.heap import freeze_startup_heap

log = logging.getLogger(__name__)


def replica_spec(args: argparse.Namespace, engine_args: EngineArgs) -> ReplicaSpec:
    """The profile named by --simulate, resized by any sizing flag given and quantized as
    --quantization or the checkpoint's quantization_config says (raises ValueError; ModelLoadError
    for a quantization or runner the engine refuses); a warning names the flags given that the
    profile cannot honour. --runner pooling (or auto on an embedding checkpoint) serves embeddings;
    a vision-language checkpoint takes images as the engine does (and refuses what it refuses)."""
    model_dir = Path(engine_args.model)
    given = {name: getattr(args, name, None) for name in OPTIONS}
    if given.get("quantization") in (None, "awq", "gptq", "compressed-tensors"):  # the checkpoint's own
        given["quantization"] = checkpoint_quantization(model_dir)
    profile = load_profile(args.simulate)
    ignored = ignored_options(profile, given)
    if ignored:
        log.warning("%s", _ignored_text(profile, ignored))
    profile = with_overrides(profile, given)
    name = engine_args.served_model_name or parse_model_uri(engine_args.model).default_served_name
    pooling = sim_pooling(model_dir, engine_args.runner, engine_args.pooler_config, name)
    vision = sim_vision(model_dir, engine_args.max_images_per_prompt, engine_args.allowed_media_domains)
    if vision is not None:
        check_vision_args(engine_args, "generate" if pooling is None else "pooling")
    if pooling is not None and engine_args.enable_lora:
        raise ModelLoadError("--runner pooling (an embedding model) does not take --enable-lora")
    return ReplicaSpec(
        profile,
        model_dir,
        name,
        enable_prefix_caching=engine_args.enable_prefix_caching,
        kv_policy=engine_args.kv_policy,
        max_waiting=engine_args.max_waiting,
        tool_call_parser=engine_args.tool_call_parser,
        chat_template=load_chat_template(engine_args.chat_template),
        reasoning_parser=engine_args.reasoning_parser,
        stream_interval=engine_args.stream_interval,
        kv_cache_dtype=engine_args.kv_cache_dtype,
        pooling=pooling,
        vision=vision,
        **_lora_fields(args, engine_args),
    )


def _lora_fields(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    """The replica's LoRA settings; each --lora-modules adapter's config read and checked as the
    engine checks it (raises AdapterError, a ValueError), its weights not read."""
    if not engine_args.enable_lora:
        return {}
    adapters = tuple(startup_adapters(engine_args.lora_modules))
    for lora in adapters:
        read_adapter_config(lora.name, lora.path, engine_args.max_lora_rank)
    return {
        "max_loras": engine_args.max_loras,
        "max_lora_rank": engine_args.max_lora_rank,
        "adapters": adapters,
        "allow_runtime_lora_updating": getattr(args, "allow_runtime_lora_updating", False)
        or EngineSettings().allow_runtime_lora_updating,  # vLLM's switch, as the engine reads it
    }


def _ignored_text(profile: Profile, ignored: list[str]) -> str:
    flags = ", ".join(cli_flag(name) for name in ignored)
    text = (
        f"--simulate ignores {flags}: the profile {profile.name!r} sets the step times, and it was "
        "modelled or fitted for one GPU type, tensor-parallel size, dtype and engine configuration; "
        "pick or calibrate a profile for another"
    )
    if "kv_cache_memory_bytes" in ignored:
        text += (
            "; this fitted profile knows no KV bytes a token (profiles `corral calibrate` writes now "
            "record them), so size its KV cache with --num-kv-blocks"
        )
    elif "gpu_memory_utilization" in ignored:
        text += "; a fitted profile knows no GPU memory: size it with --kv-cache-memory or --num-kv-blocks"
    if "quantization" in ignored:
        text += (
            "; a fitted profile's step times are those of the weights it was calibrated with, so "
            "--quantization (or the checkpoint's quantization_config) changes nothing: calibrate the "
            "quantized engine"
        )
    return text


def _tower_text(profile: Profile, vision: SimVision) -> str:
    """What the replica's steps that embed images add: the tower's size and an image's time (a
    Qwen-VL tower's for an image of 32x32 patches: its cost follows each image's size)."""
    cost = vision_cost(profile, vision.config)
    tower = cost.tower
    grid: Grid = None
    if isinstance(tower, QwenTowerShape):
        grid, side = (1, 32, 32), 32 * tower.patch_size  # 448 pixels at Qwen-VL's 14-pixel patches
        shape, what = (
            f"{tower.num_layers} layers of {tower.embed_dim}",
            f"a {side}x{side} image (1,024 patches)",
        )
    else:
        assert isinstance(tower, TowerShape)  # the two towers vision_cost builds
        shape, what = (
            f"{tower.num_layers} layers run of {tower.hidden_size}, {tower.num_patches} patches",
            "an image",
        )
    return (
        f"vision tower (the checkpoint's vision_config, costed on {profile.name}): {shape}, "
        f"{tower.num_params / 1e6:.1f} M parameters, {tower.flops(grid) / 1e9:.2f} GFLOP {what}; "
        f"a step embedding 1 such image adds {1e3 * cost.step_time_s([grid]):.3f} ms, "
        f"4 images {1e3 * cost.step_time_s([grid] * 4):.3f} ms"
    )


def run_simulated(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    if args.replicas < 1:
        log.error("--replicas must be at least 1")
        return 2
    try:
        spec = replica_spec(args, engine_args)
    except ModelLoadError as e:
        log.error("cannot load the model: %s", e)
        return 1
    except ValueError as e:
        log.error("%s", e)
        return 2
    log.info("simulating %s: %s", spec.profile.name, describe(spec.profile))
    if spec.vision is not None:
        log.info("%s", _tower_text(spec.profile, spec.vision))
    try:
        if args.replicas == 1:
            from corral_engine.server import create_app
            from corral_engine.server.lifecycle import serve

            [engine] = build_engines(spec, 1)
            app = create_app(
                engine,
                api_key=args.api_key,
                log_interval_s=args.log_interval,
                tool_call_parser=spec.tool_call_parser,
                chat_template=spec.chat_template,
                reasoning_parser=spec.reasoning_parser,
            )
            freeze_startup_heap()
            serve(app.state.ctx, app, args.host, args.port, args.drain_timeout)
            return 0
        ports = list(range(args.port, args.port + args.replicas))
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            fleet = serve_fleet(
                spec, args.host, ports, args.api_key, freeze_startup_heap, drain_timeout_s=args.drain_timeout
            )
            runner.run(fleet)
    except ModelLoadError as e:
        log.error("cannot load the model: %s", e)
        return 1
    return 0


def _loop_factory():  # type: ignore[no-untyped-def]
    """uvloop's loop where installed: 64 replicas' servers share one event loop."""
    if importlib.util.find_spec("uvloop") is None:
        return None
    import uvloop

    return uvloop.new_event_loop
