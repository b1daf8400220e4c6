"""An embedding engine's half of `LLMEngine` (--runner pooling): the runner chosen at start-up with
what it refuses, and the step that runs prompt chunks and ends each request with its vector (a
cross-encoder's: its scores)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import SchedulerOutput
from corral_engine.errors import ModelLoadError
from corral_engine.model.config import ModelConfig
from corral_engine.model.encoder_runner import EncoderRunner
from corral_engine.model.pooler import Pooler, finish_output
from corral_engine.model.runner import ModelRunner
from corral_engine.outputs import RequestOutput
from corral_engine.pooling import PoolerConfig, Runner, choose_runner, resolve_pooler

if TYPE_CHECKING:
    from corral_engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def choose_runner_for(args: EngineArgs, config: ModelConfig) -> tuple[Runner, PoolerConfig | None]:
    """--runner resolved for this checkpoint, and for pooling its pooler; what a pooling engine
    cannot do (or a base model without an LM head cannot) is refused before the model loads."""
    encoder = config.encoder
    is_encoder = encoder is not None  # BERT and kin: pooling only (choose_runner picks it for auto)
    runner = choose_runner(args.runner, list(config.declared_architectures))
    if runner == "generate":
        if config.is_base_model or is_encoder:
            what = "an encoder" if is_encoder else "a base model without an LM head"
            raise ModelLoadError(
                f"{config.declared_architectures[0]} is {what}: it serves "
                f"{'scores' if config.num_labels else 'embeddings'} only (--runner pooling)"
            )
        return runner, None
    flags = (
        ("--speculative", args.speculative is not None),
        ("--enable-lora", args.enable_lora),
        ("--tensor-parallel-size > 1", args.tensor_parallel_size > 1),
        ("--quantization (an encoder runs in its own precision)", is_encoder and bool(args.quantization)),
    )
    refused = [flag for flag, is_set in flags if is_set]
    if refused:
        raise ModelLoadError(f"--runner pooling (an embedding model) does not take {', '.join(refused)}")
    # Without sentence-transformers files an encoder pools its first token ([CLS]), as vLLM's BERT.
    pooler = resolve_pooler(config.path, args.pooler_config, "CLS" if is_encoder else "LAST")
    if encoder is not None and encoder.is_token_classifier:
        logger.info("runner: pooling (a token classifier: %d labels a token, /pooling)", config.num_labels)
        return runner, pooler
    if config.num_labels:  # its head reads the first token whatever the pooler says
        logger.info(
            "runner: pooling (a cross-encoder: %d classifier output(s), /v1/score and /v1/rerank)",
            config.num_labels,
        )
        return runner, pooler
    logger.info(
        "runner: pooling (embeddings of %d values; %s pooling, %s)",
        config.hidden_size,
        pooler.pooling_type,
        "normalized" if pooler.normalize else "not normalized",
    )
    return runner, pooler


def can_cache_prefixes(args: EngineArgs, pooler: PoolerConfig | None, is_encoder: bool) -> bool:
    """Whether prefix caching is on. A cached prefix's positions are skipped, and MEAN and CLS
    pooling need their hidden states; LAST needs only the last position, always computed (causal
    attention: the cached keys and values give it the same result). An encoder has no cache, and
    a position's state there depends on the tokens after it."""
    if not args.enable_prefix_caching or is_encoder:
        return False
    if pooler is None or pooler.pooling_type == "LAST":
        return True
    logger.info("prefix caching off: %s pooling reads every prompt position", pooler.pooling_type)
    return False


class PoolingStep:
    """The step of an engine that pools: no sampler, detokenizer or stop rules."""

    def __init__(self, engine: LLMEngine, config: PoolerConfig) -> None:
        self.engine = engine
        self.config = config
        self.pooler = Pooler(config.pooling_type)

    def step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """The scheduled prompt chunks run; each request whose prompt is now complete ends with its
        vector (finish reason "stop", as vLLM's pooling requests end), its blocks freed at once
        (full ones stay in the prefix cache where it is on)."""
        engine = self.engine
        runner = engine.runner
        if not isinstance(runner, ModelRunner | EncoderRunner):  # refused at start-up (choose_runner_for)
            raise RuntimeError("pooling runs on one rank")
        vectors = runner.pool(sched.scheduled, self.pooler)
        now = time.monotonic()
        outputs = []
        for s in sched.scheduled:
            seq, request = s.seq, s.seq.request
            seq.num_computed_tokens += s.num_new_tokens
            engine.block_manager.register_computed(seq)
            vector = vectors.get(seq.seq_id)
            if vector is None or request.pooling is None:
                continue
            seq.finish_reason = "stop"
            engine.scheduler.finish(seq)
            engine._stats.num_prompt_tokens_total += len(request.prompt_token_ids)
            request.metrics.first_token_time = request.metrics.last_token_time = now
            embedding = finish_output(vector, request.pooling, self.config.normalize)
            output = RequestOutput(
                request.request_id, request.prompt_token_ids, [], True, request.metrics, embedding=embedding
            )
            outputs.append(engine._finish_request(request, output))
        engine._stats.num_steps_total += 1
        return outputs
