"""The model builder: a runner's model made on its device (built on the meta device, its quantized
layers, its weights loaded, the matmul plan applied and the fused and Triton ops hooked in)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from corral_engine.model.config import ModelConfig
from corral_engine.model.device import CpuFeatures, available_memory_bytes
from corral_engine.model.int4_ops import has_int4_kernel
from corral_engine.model.llama import MLP, Attention, CausalLM, Linear, RMSNorm
from corral_engine.model.loader import load_weights
from corral_engine.model.matmul_plan import MatmulPlan, plan_matmuls
from corral_engine.model.native import load_amx_linear, load_fused_ops
from corral_engine.model.parallel import TensorParallel
from corral_engine.model.quant import QuantConfig, QuantPlan, plan_quant
from corral_engine.model.quant_layers import describe_quantized, quantize_layers, ready
from corral_engine.model.quant_ops import has_int8_kernel
from corral_engine.model.rotary import Rotary, rope_parameters
from corral_engine.settings import EngineSettings

if TYPE_CHECKING:
    from corral_engine.model.triton_ops import TritonOps

# These lines belong to the runner's start-up log: they keep its logger's name.
logger = logging.getLogger("corral_engine.model.runner")


def device_quant_plan(
    quant: QuantConfig | None, device: torch.device, dtype: torch.dtype, int4_switch: str = "auto"
) -> QuantPlan:
    """How this device runs the quantization asked for (model/quant.py:plan_quant)."""
    is_cuda = device.type == "cuda"
    capability = torch.cuda.get_device_capability(device) if is_cuda else None
    wants_int8 = quant is not None and quant.method == "int8"
    int8 = has_int8_kernel(device) if is_cuda and wants_int8 else True
    wants_int4 = quant is not None and quant.bits == 4 and dtype == torch.bfloat16
    int4 = has_int4_kernel(device) if is_cuda and wants_int4 else True
    dtype_name = str(dtype).removeprefix("torch.")
    return plan_quant(quant, device.type, capability, dtype_name, int8, int4, int4_switch)


@dataclass(frozen=True, slots=True)
class ModelBuilder:
    """What a runner builds its model for: the checkpoint, this rank's share, its device and dtype."""

    config: ModelConfig
    tp: TensorParallel | None
    is_pooling: bool  # no LM head
    dtype: torch.dtype
    device: torch.device
    cpu: CpuFeatures
    settings: EngineSettings
    max_model_len: int
    quant: QuantConfig | None
    quant_plan: QuantPlan

    def build(self) -> tuple[CausalLM, MatmulPlan]:
        with torch.device("meta"):
            model = self._new_model().to(self.dtype)
        kind, quant = self.quant_plan.weights, self.quant
        # Quantized layers get their int8/fp8 weights while still on the meta device: the model is
        # never held whole in the model dtype.
        quantized, kept = quantize_layers(model, kind, quant) if kind and quant else ([], [])
        model = model.to_empty(device=self.device)
        # Moving off the meta device unties shared parameters (an embedding model has no LM head).
        if self.config.tie_word_embeddings and model.lm_head is not None:
            model.lm_head.weight = model.model.embed_tokens.weight
        load_weights(model, self.config, None if self.tp is None else self.tp.plan, quant)
        quantized = [linear for linear in quantized if linear.quant is not None]  # int4: act-order ones not
        ready(quantized, self.dtype)
        if self.quant_plan.note:
            level = logging.WARNING if self.quant_plan.is_warning else logging.INFO
            logger.log(level, "%s", self.quant_plan.note)
        if quantized or kept:
            logger.info("%s", describe_quantized(quantized, kept, self.dtype))
        plan = self._apply_matmul_plan(model)
        fused_ops = load_fused_ops(self.settings) if self.device.type == "cpu" else None
        triton_ops = self._triton_ops()
        for module in model.modules():
            if isinstance(module, RMSNorm | MLP | Attention):
                module.fused_ops = fused_ops
                module.triton_ops = triton_ops
            if isinstance(module, Linear) and plan.kernel_rows and module.quant is None:  # the native kernel
                # Checked once here, not on every call: the weight's layout does not change.
                readable = fused_ops is not None and fused_ops.supports(module.weight)
                module.fused_ops = fused_ops if readable else None
        for rotary in cast("list[Rotary]", list(model.rotaries)):
            # LongRoPE picks its factor set by the engine's context length (rotary.rope_parameters).
            inv_freq, _ = rope_parameters(self.config, rotary.kind, self.max_model_len)
            rotary.inv_freq = inv_freq.to(self.device)  # float32 on purpose, as transformers keeps it
        return model.eval(), plan

    def _new_model(self) -> CausalLM:
        if self.config.vision is not None:  # the engine refuses TP and pooling for these first
            from corral_engine.model.llava import LlavaLM
            from corral_engine.model.qwen_vl import QwenVLM
            from corral_engine.qwen_vision_config import QwenVisionConfig

            is_qwen = isinstance(self.config.vision, QwenVisionConfig)
            return QwenVLM(self.config) if is_qwen else LlavaLM(self.config)
        return CausalLM(self.config, self.tp, has_lm_head=not self.is_pooling)

    def _triton_ops(self) -> TritonOps | None:
        mode = self.settings.triton_ops
        if mode == "0" or (mode == "auto" and self.device.type != "cuda"):
            return None
        from corral_engine.model.triton_ops import TritonOps  # imports triton: only where used

        return TritonOps()

    def _apply_matmul_plan(self, model: CausalLM) -> MatmulPlan:
        # Quantized layers run their own kernel: no packing, upcast copies or native bf16 kernel.
        linears = [m for m in model.modules() if isinstance(m, Linear) and m.quant is None]
        plan = plan_matmuls(
            self.dtype,
            self.device.type == "cpu",
            self.cpu,
            self.settings.prepack,
            self.settings.bf16_upcast,
            upcast_copy_bytes=sum(m.weight.numel() for m in linears) * 4,
            available_bytes=available_memory_bytes(),
            small_batch_kernel=self.settings.small_batch_kernel,
            amx_linear=self.settings.amx_linear,
        )
        for note in plan.notes:
            logger.info("%s", note)
        is_packed = plan.prepack
        # bf16 on a CPU with AMX tiles: Corral's AMX kernel instead of oneDNN, layer by layer where
        # it takes the weight (and where it built: else oneDNN throughout)
        amx = load_amx_linear(self.settings) if plan.amx_linear else None
        num_amx = 0
        for linear in linears:
            linear.upcast_min_rows = plan.upcast_min_rows
            linear.kernel_rows = plan.kernel_rows
            if plan.keep_upcast_copies:
                linear.prepack_upcast()
            if is_packed:
                # the small-batch kernel reads the plain weight
                keep_weight = (
                    linear is model.lm_head and self.config.tie_word_embeddings
                ) or plan.kernel_rows > 0
                if amx is not None and linear.prepack_amx(amx, keep_weight):
                    num_amx += 1
                    continue
                try:
                    linear.prepack(keep_weight)
                except RuntimeError as e:  # e.g. bf16 packing needs AVX512 or AVX-NE-CONVERT
                    logger.info("Linear weights stay unpacked: %s", e)
                    is_packed = False
        if num_amx:
            logger.info(
                "%d of %d Linear layers multiply through AMX tiles (kernels/amx_linear.c)",
                num_amx,
                len(linears),
            )
        if is_packed and num_amx < len(linears):
            logger.info("Linear weights prepacked for oneDNN (%s)", str(self.dtype).removeprefix("torch."))
        # what was done, not what was asked
        return dataclasses.replace(plan, prepack=is_packed, amx_linear=num_amx > 0)
