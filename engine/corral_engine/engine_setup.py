"""An engine's set-up choices, made once as it starts from its arguments, its model's config and its
runner: the context length, the served model's EmbedSpec, the scheduler and how its steps pipeline
(each logged)."""

from __future__ import annotations

import logging

from corral_engine.args import EngineArgs
from corral_engine.core.block_manager import BlockManager
from corral_engine.core.scheduler import Scheduler, SchedulerConfig
from corral_engine.errors import ModelLoadError
from corral_engine.model.config import ModelConfig
from corral_engine.pooling import EmbedSpec, Runner
from corral_engine.settings import EngineSettings

# These lines belong to the engine's start-up log: they keep its logger's name.
logger = logging.getLogger("corral_engine.llm_engine")


def context_length(args: EngineArgs, model_config: ModelConfig) -> int:
    """The engine's max_model_len: --max-model-len up to the model's positions (warned past them)."""
    max_model_len = min(
        args.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
    )
    if args.max_model_len and args.max_model_len > max_model_len:
        logger.warning(
            "--max-model-len %d is past the model's %d positions: serving %d",
            args.max_model_len, max_model_len, max_model_len,
        )  # fmt: skip
    return max_model_len


def embed_spec(
    served_model_name: str, runner: Runner, is_pooling: bool, model_config: ModelConfig
) -> EmbedSpec:
    """What requests' checks and responses need of the served model: its runner, and a pooling
    one's vector size, matryoshka dimensions or classifier labels."""
    encoder = model_config.encoder  # a classifier's labels and problem type are its
    return EmbedSpec(
        served_model_name,
        runner,
        model_config.hidden_size if is_pooling else 0,
        model_config.is_matryoshka,
        model_config.matryoshka_dimensions,
        num_labels=model_config.num_labels,
        labels=() if encoder is None else encoder.labels,
        problem_type=None if encoder is None else encoder.problem_type,
        is_token_classifier=encoder is not None and encoder.is_token_classifier,
        is_encoder=encoder is not None,
    )


def make_scheduler(
    args: EngineArgs, num_kv_blocks: int, max_model_len: int, is_encoder: bool, can_cache_prefixes: bool
) -> Scheduler:
    """The scheduler over a BlockManager of the runner's KV blocks (warned when they hold fewer
    tokens than the context length)."""
    block_manager = BlockManager(num_kv_blocks, args.block_size, can_cache_prefixes)
    warn_if_cache_short(num_kv_blocks, args.block_size, max_model_len)
    return Scheduler(scheduler_config(args, max_model_len, is_encoder), block_manager)


def warn_if_cache_short(num_kv_blocks: int, block_size: int, max_model_len: int) -> None:
    kv_tokens = num_kv_blocks * block_size
    if kv_tokens < max_model_len:  # vLLM refuses to start; a test may want a tiny cache
        logger.warning(
            "the KV cache holds %d tokens, fewer than max_model_len %d: a request longer than "
            "that is refused (give the cache more memory or set --max-model-len %d)",
            kv_tokens, max_model_len, kv_tokens,
        )  # fmt: skip


def scheduler_config(args: EngineArgs, max_model_len: int, is_encoder: bool) -> SchedulerConfig:
    max_loras = args.max_loras if args.enable_lora else 0
    # An encoder attends both ways: its prompts run whole, so a step takes at least the longest.
    budget = max(args.max_num_batched_tokens, max_model_len if is_encoder else 0)
    return SchedulerConfig(
        args.max_num_seqs, budget, args.kv_policy, max_loras, can_chunk_prompts=not is_encoder
    )


def pipelining(
    settings: EngineSettings, on_cuda: bool, fills_inputs_on_device: bool, is_speculative: bool
) -> tuple[bool, bool]:
    """Whether the output overlap and async scheduling are on (logged); auto: on CUDA. On CPU
    the forward pass runs inside runner.execute: no idle device to overlap with."""
    overlap, mode = settings.overlap_output, settings.async_scheduling
    overlaps_output = overlap == "1" or (overlap == "auto" and on_cuda)
    logger.info("output overlap: %s", "on" if overlaps_output else "off")
    schedules_ahead = (
        (mode == "1" or (mode == "auto" and on_cuda)) and fills_inputs_on_device and not is_speculative
    )
    logger.info("async scheduling: %s", "on" if schedules_ahead else "off")
    return overlaps_output, schedules_ahead


def check_vision_args(args: EngineArgs, runner: str) -> None:
    """Refuse, by name, what a vision-language model is not served with yet (ModelLoadError)."""
    refused = [
        name
        for name, is_set in (
            ("--enable-lora", args.enable_lora),
            ("--tensor-parallel-size > 1", args.tensor_parallel_size > 1),
            ("--speculative", bool(args.speculative)),
            ("--runner pooling", runner == "pooling"),
        )
        if is_set
    ]
    if refused:
        raise ModelLoadError(
            f"{', '.join(refused)}: not supported with a vision-language model (LLaVA, Qwen-VL) yet"
        )
