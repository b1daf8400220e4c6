"""The model runner: builds the model on its device with its matmul plan, owns the KV cache and
executes a step (batch building: model/batch.py; device and CPU features: model/device.py)."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.model.batch import BatchBuilder
from corral_engine.model.config import ModelConfig
from corral_engine.model.device import (
    CpuFeatures,
    available_memory_bytes,
    probe_cpu,
    select_device,
    select_dtype,
)
from corral_engine.model.kv_cache import allocate_kv_caches, num_kv_blocks
from corral_engine.model.llama import MLP, CausalLM, Linear, RMSNorm, rope_parameters
from corral_engine.model.loader import load_weights
from corral_engine.model.matmul_plan import MatmulPlan, plan_matmuls
from corral_engine.model.native import load_fused_ops, load_paged_decode
from corral_engine.settings import EngineSettings

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        args: EngineArgs,
        max_model_len: int,
        settings: EngineSettings,
        cpu: CpuFeatures | None = None,  # this machine's (probe_cpu) unless a test fakes them
    ) -> None:
        self.config = config
        self.block_size = args.block_size
        self.settings = settings
        self.cpu = cpu or probe_cpu()
        self.device = select_device(args.device)
        self.dtype = select_dtype(args.dtype, self.device, config.torch_dtype, self.cpu)
        is_cpu = self.device.type == "cpu"
        # The native paged decode kernel when it builds here (CPU, bf16/fp32); else PyTorch SDPA.
        kernel = load_paged_decode(settings) if settings.batched_decode and is_cpu else None
        self.batches = BatchBuilder(
            args.block_size,
            -(-max_model_len // args.block_size),
            self.device,
            settings.batched_decode,
            kernel if kernel is not None and kernel.supports(self.dtype, self.device) else None,
        )
        if is_cpu:
            torch.set_num_threads(args.num_threads or max(1, len(os.sched_getaffinity(0))))
        self.model, self.matmul_plan = self._build_model()
        bytes_per_block = args.block_size * config.kv_bytes_per_token * self.dtype.itemsize
        self.num_kv_blocks = num_kv_blocks(args, bytes_per_block, max_model_len)
        shape = (self.num_kv_blocks, self.block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = allocate_kv_caches(config.num_layers, shape, self.dtype, self.device)
        logger.info(
            "model %s on %s/%s: %d KV blocks of %d tokens",
            config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_kv_blocks,
            self.block_size,
        )

    def _build_model(self) -> tuple[CausalLM, MatmulPlan]:
        with torch.device("meta"):
            model = CausalLM(self.config)
        model = model.to_empty(device=self.device).to(self.dtype)
        if self.config.tie_word_embeddings:  # moving off the meta device unties shared parameters
            model.lm_head.weight = model.model.embed_tokens.weight
        load_weights(model, self.config)
        plan = self._apply_matmul_plan(model)
        fused_ops = load_fused_ops(self.settings) if self.device.type == "cpu" else None
        for module in model.modules():
            if isinstance(module, RMSNorm | MLP):
                module.fused_ops = fused_ops
        inv_freq, _ = rope_parameters(self.config)
        model.rotary.inv_freq = inv_freq.to(self.device)  # float32 on purpose, as transformers keeps it
        return model.eval(), plan

    def _apply_matmul_plan(self, model: CausalLM) -> MatmulPlan:
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        plan = plan_matmuls(
            self.dtype,
            self.device.type == "cpu",
            self.cpu,
            self.settings.prepack,
            self.settings.bf16_upcast,
            upcast_copy_bytes=sum(m.weight.numel() for m in linears) * 4,
            available_bytes=available_memory_bytes(),
        )
        for note in plan.notes:
            logger.info("%s", note)
        is_packed = plan.prepack
        for linear in linears:
            linear.upcast_min_rows = plan.upcast_min_rows
            if plan.keep_upcast_copies:
                linear.prepack_upcast()
            if is_packed:
                is_shared = linear is model.lm_head and self.config.tie_word_embeddings
                try:
                    linear.prepack(keep_weight=is_shared)
                except RuntimeError as e:  # e.g. bf16 packing needs AVX512 or AVX-NE-CONVERT
                    logger.info("Linear weights stay unpacked: %s", e)
                    is_packed = False
        if is_packed:
            logger.info("Linear weights prepacked for oneDNN (%s)", str(self.dtype).removeprefix("torch."))
        return dataclasses.replace(plan, prepack=is_packed)  # what was done, not what was asked

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; return float32 logits for the sequences that sample, in order: one row
        each, plus one per draft token of speculating sequences."""
        batch = self.batches.prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.ctx)
        if batch.logits_indices.numel() == 0:
            return torch.empty((0, self.config.vocab_size))
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    def release(self, seq_id: int) -> None:
        """A sequence finished: drop what the runner keeps for it across steps."""
        self.batches.release(seq_id)
