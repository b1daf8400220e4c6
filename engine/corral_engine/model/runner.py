"""The model runner: builds the model on its device with its matmul plan, chooses the attention
backend, sizes and owns the KV cache, captures decode graphs on CUDA and executes a step (the model
itself: model/builder.py; batch building: model/batch.py; device and CPU features: model/device.py;
graphs: model/cuda_graphs.py).
Under tensor parallelism (`tp`) it is one rank's runner: its shard of the model and of the KV cache
(its KV heads, the same blocks as every rank); model/tp_workers.py drives the other ranks."""

from __future__ import annotations

import logging
import os
import time

import torch

from corral_engine.args import EngineArgs
from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.errors import ModelLoadError
from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.model.attention import choose_attention_backend, prompt_block_rows
from corral_engine.model.batch import BatchBuilder, TokenFill
from corral_engine.model.builder import ModelBuilder, device_quant_plan
from corral_engine.model.config import ModelConfig
from corral_engine.model.cuda_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture
from corral_engine.model.decode_stack import DecodeStack, unsupported
from corral_engine.model.device import CpuFeatures, probe_cpu, select_device, select_dtype
from corral_engine.model.image_cache import ImageEmbeddings
from corral_engine.model.kv_cache import (
    TorchCudaMemory,
    allocate_kv_caches,
    gpu_kv_cache_bytes,
    maximal_step,
    num_kv_blocks,
    profile_gpu_memory,
    used_outside_torch,
)
from corral_engine.model.kv_dtype import kv_cache_dtype
from corral_engine.model.llava import LlavaLM
from corral_engine.model.lora import LoraSlots, fast_paths, lora_slot_dtype
from corral_engine.model.mrope import MropePositions
from corral_engine.model.native import load_decode_stack_library, load_fused_ops, load_paged_decode
from corral_engine.model.parallel import TensorParallel
from corral_engine.model.pooler import Pooler, PoolSpan
from corral_engine.model.quant import model_quant_config
from corral_engine.model.qwen_vl import QwenVLM
from corral_engine.model.sampler import sample_rows
from corral_engine.sampling_params import SamplingParams
from corral_engine.settings import EngineSettings

logger = logging.getLogger(__name__)
# What the memory profile samples with: every filter on, so its peak is sampling's largest.
PROFILED_SAMPLING = SamplingParams(max_tokens=1, top_k=50, top_p=0.9, min_p=0.05)


class ModelRunner:
    fills_inputs_on_device = True  # execute takes a TokenFill (async scheduling)

    def __init__(
        self,
        config: ModelConfig,
        args: EngineArgs,
        max_model_len: int,
        settings: EngineSettings,
        cpu: CpuFeatures | None = None,  # this machine's (probe_cpu) unless a test fakes them
        graph_capture: GraphCapture | None = None,  # CUDA graphs on CUDA; tests pass EagerCapture
        tp: TensorParallel | None = None,  # this rank's place when the model is split across ranks
    ) -> None:
        self.config = config
        self.tp = tp
        num_ranks = 1 if tp is None else tp.size
        self.num_kv_heads = config.num_kv_heads if tp is None else tp.plan.num_kv_heads
        self.args = args
        # An embedding model (--runner pooling, resolved by the engine): no LM head, no sampling,
        # no decode steps (so no decode graphs or native decode stack).
        self.is_pooling = args.runner == "pooling"
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.settings = settings
        self.cpu = cpu or probe_cpu()
        self.device = select_device(args.device)
        if tp is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
        # What the card already holds (other engines, this process's CUDA context): not this
        # engine's share of --gpu-memory-utilization.
        self._memory_at_start = (
            used_outside_torch(TorchCudaMemory(self.device)) if self.device.type == "cuda" else 0
        )
        self.dtype = select_dtype(args.dtype, self.device, config.torch_dtype, self.cpu)
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        is_cpu = self.device.type == "cpu"
        self.quant = model_quant_config(args.quantization, config.quantization_config, config.is_moe)
        self.quant_plan = device_quant_plan(self.quant, self.device, self.dtype, settings.int4_kernel)
        # The native paged decode kernel when it builds here (CPU, bf16/fp32; a cache in that
        # dtype or fp8); else PyTorch SDPA.
        kernel = load_paged_decode(settings) if settings.batched_decode and is_cpu else None
        if kernel is not None and not kernel.supports(self.dtype, self.device, self.kv_dtype):
            kernel = None
        softcap = None if config.family is None else config.family.attn_logit_softcapping
        self.attention_backend = choose_attention_backend(
            args.attention_backend,
            self.device.type,
            kernel is not None,
            settings.triton_interpret,
            bool(softcap),
        )
        group = config.num_heads // config.num_kv_heads
        amx_shapes = (self.dtype, self.kv_dtype, args.block_size, group, config.head_dim)
        if kernel is not None and self.attention_backend == "native" and kernel.uses_amx(*amx_shapes):
            logger.info("paged decode attention scores and sums with AMX tiles")
        # Prompt blocks' masked softmax in one native pass, and the KV cache write as row copies,
        # where the fused ops build (bf16).
        fused = load_fused_ops(settings) if is_cpu and self.dtype == torch.bfloat16 else None
        self.batches = BatchBuilder(
            args.block_size,
            -(-max_model_len // args.block_size),
            self.device,
            settings.batched_decode,
            kernel if self.attention_backend == "native" else None,
            unified=self.attention_backend == "triton",
            prompt_block_rows=prompt_block_rows(
                self.dtype,
                is_cpu and self.attention_backend != "triton",
                self.cpu.has_native_bf16,
                settings.matmul_prompt_attention,
                native_softmax=fused is not None,
            ),
            prompt_softmax=fused.causal_softmax if fused is not None else None,
            kv_write=fused.write_kv if fused is not None else None,
        )
        if is_cpu:
            # The cores are shared between the ranks on this machine.
            num_cores = len(os.sched_getaffinity(0))
            torch.set_num_threads(args.num_threads or max(1, num_cores // num_ranks))
        # Triton compiles a kernel variant on its first launch; a count that grows after the
        # warm-up is a step that stalled on a compile (logged: a variant the warm-up missed).
        self._compiled_variants: int | None = None
        builder = ModelBuilder(
            config=config,
            tp=tp,
            is_pooling=self.is_pooling,
            dtype=self.dtype,
            device=self.device,
            cpu=self.cpu,
            settings=settings,
            max_model_len=max_model_len,
            quant=self.quant,
            quant_plan=self.quant_plan,
        )
        self.model, self.matmul_plan = builder.build()
        # A vision-language model's encoder cache (model/image_cache.py); None for text models.
        self.images: ImageEmbeddings | None = None
        if isinstance(self.model, LlavaLM | QwenVLM):
            self.images = ImageEmbeddings(self.model, self.device, self.dtype)
        # Qwen-VL's M-RoPE positions (model/mrope.py); None for every other model.
        merge = self.model.vision_config.spatial_merge_size if isinstance(self.model, QwenVLM) else 0
        self.mrope = MropePositions(merge, self.device) if merge else None
        self.graphs: DecodeGraphs | None = None
        kv_per_token = 2 * config.num_layers * self.num_kv_heads * config.head_dim
        bytes_per_block = args.block_size * kv_per_token * self.kv_dtype.itemsize
        measured = self._gpu_kv_bytes if self.device.type == "cuda" else None
        self.num_kv_blocks = num_kv_blocks(args, bytes_per_block, max_model_len, measured)
        if tp is not None:  # one block table for all ranks: the smallest cache sets the count
            self.num_kv_blocks = tp.all_reduce_min(self.num_kv_blocks)
        shape = (self.num_kv_blocks, self.block_size, self.num_kv_heads, config.head_dim)
        self.kv_caches = allocate_kv_caches(config.num_layers, shape, self.kv_dtype, self.device)
        logger.info(
            "model %s on %s/%s: %d KV blocks of %d tokens (%s), %s attention%s",
            config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_kv_blocks,
            self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            self.attention_backend,
            self._prompt_path(),
        )
        if config.moe is not None:
            logger.info(
                "mixture of experts: %d experts, %d per token; no decode graphs or native decode stack",
                config.moe.num_experts,
                config.moe.num_experts_per_tok,
            )
        self.lora = self._lora_slots()
        # The native decode stack and decode graphs know nothing of adapters: with LoRA they run
        # only steps without adapter rows (`fast_paths`), whose Linear wrappers add nothing.
        self.decode_stack = None if self.is_pooling else self._decode_stack()
        self.model.decode_stack = self.decode_stack
        # No decode graphs for mixture-of-experts models: routing reads each expert's row count on
        # the host every layer (its matmul shapes depend on the batch's data), which a graph cannot
        # record; their decodes run eagerly.
        is_graphable = tp is None and not config.is_moe and not self.is_pooling
        if self.attention_backend == "triton" and not args.enforce_eager and is_graphable:
            if graph_capture is None and self.device.type == "cuda":
                graph_capture = CudaGraphCapture()
            if graph_capture is not None:
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(
                        lambda ids, positions, ctx: self.model(ids, positions, self.kv_caches, ctx),
                        graph_capture,
                        args.max_num_seqs,
                        -(-max_model_len // args.block_size),
                        args.block_size,
                        self.device,
                    )
        if self.attention_backend == "triton" and self.device.type == "cuda" and tp is None:
            self._warm_up_attention()

    def _lora_slots(self) -> LoraSlots | None:
        """The adapters' device slots with --enable-lora (dense models only), else None."""
        if not self.args.enable_lora:
            return None
        if self.config.is_moe:
            raise ModelLoadError("--enable-lora is not supported for mixture-of-experts models yet")
        slot_dtype = lora_slot_dtype(self.dtype, self.matmul_plan, self.settings.lora_upcast)
        logger.info(
            "LoRA: %d adapter slots of rank %d in %s; host memory for %d adapters",
            self.args.max_loras,
            self.args.max_lora_rank,
            str(slot_dtype).removeprefix("torch."),
            self.args.max_cpu_loras or self.args.max_loras,
        )
        args = self.args
        return LoraSlots(
            self.model, args.max_loras, args.max_lora_rank, slot_dtype, self.device, args.max_cpu_loras
        )

    def add_lora(self, lora: LoraRequest) -> None:
        """Read and register an adapter (AdapterError when it cannot be served)."""
        if self.lora is None:
            raise AdapterError("LoRA is off: start the engine with --enable-lora")
        self.lora.add(lora)

    def remove_lora(self, lora_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_id)

    def stage_lora(self, lora_id: int) -> None:
        """Have a registered adapter's weights at hand, read again from its path if the host
        cache dropped them (AdapterError when it can no longer be read)."""
        if self.lora is not None:
            self.lora.stage(lora_id)

    def _warm_up_attention(self) -> None:
        """Every attention variant a batch can launch, compiled before the first request."""
        from corral_engine.model import triton_attention

        started = time.perf_counter()
        before = triton_attention.compiled_variants()
        q_like = torch.empty(
            (1, self.config.num_heads, self.config.head_dim), dtype=self.dtype, device=self.device
        )
        k_cache, v_cache = self.kv_caches[0][0], self.kv_caches[0][1]
        family = self.config.family
        softcap = None if family is None else family.attn_logit_softcapping  # a constexpr too
        for window in dict.fromkeys(self.config.sliding_windows):  # WINDOW is a constexpr
            triton_attention.warm_up(q_like, k_cache, v_cache, 1.0, window, softcap)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._compiled_variants = triton_attention.compiled_variants()
        logger.info(
            "attention warm-up: %d kernel variants compiled or loaded from Triton's cache in %.1f s",
            self._compiled_variants - before,
            time.perf_counter() - started,
        )

    def _watch_compiles(self, num_tokens: int, num_seqs: int) -> None:
        from corral_engine.model import triton_attention

        count = triton_attention.compiled_variants()
        if self._compiled_variants is not None and count > self._compiled_variants:
            logger.warning(
                "a step of %d tokens over %d sequences compiled %d new Triton kernel variant(s) "
                "after the warm-up: it stalled for the compile",
                num_tokens,
                num_seqs,
                count - self._compiled_variants,
            )
        self._compiled_variants = count

    def _decode_stack(self) -> DecodeStack | None:
        """The native decoder for decode batches the small-batch kernel takes (see
        model/decode_stack.py), where it builds and takes this model."""
        rows = self.matmul_plan.kernel_rows
        if not rows or self.attention_backend != "native" or self.batches.kv_write is None:
            return None
        lib = load_decode_stack_library(self.settings)
        if lib is None:
            return None
        problem = unsupported(self.model, self.kv_caches)
        if problem:
            logger.info("decode batches go layer by layer: the native decode stack does not take %s", problem)
            return None
        logger.info("decode batches of fewer than %d rows run the whole decoder natively in one call", rows)
        return DecodeStack(lib, self.model, self.kv_caches, rows)

    def _prompt_path(self) -> str:
        """How prompt chunks attend, for the start-up log line ("" for the default SDPA path)."""
        if not self.batches.prompt_block_rows:
            return ""
        return (
            " (prompts: batched matmuls, native softmax)"
            if self.batches.prompt_softmax
            else " (prompts: batched matmuls)"
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], fill: TokenFill | None = None) -> torch.Tensor:
        """Run one step; return float32 logits for the sequences that sample, in order: one row
        each, plus one per draft token of speculating sequences. `fill`: input tokens the last
        step sampled that are still on the device (their sequences hold PENDING_TOKEN)."""
        graphs = self.graphs
        if self.lora is not None:
            self.lora.prepare(scheduled)
            self.model.decode_stack, graphs = fast_paths(bool(self.lora.groups), self.decode_stack, graphs)
        # Steps that prefill image placeholders run eagerly: no captured graph merges embeddings.
        has_images = self.images is not None and self.images.has_images(scheduled)
        if graphs is not None and len(scheduled) <= graphs.sizes[-1] and not has_images:
            host = self.batches.prepare_unified(scheduled)
            if host.is_plain_decode:
                pending = None
                if self.mrope is not None:  # Qwen-VL: decodes past an image run at index + delta
                    self.mrope.shift_decodes(host.positions, scheduled)
                if fill is not None:
                    dst, src = fill.targets(scheduled)  # a decode's row is its sequence's index
                    pending = (fill.tokens, dst, src)
                hidden = graphs.run(host, self.batches.block_tables(host), pending)
                return self.model.compute_logits(hidden)
            batch = self.batches.to_step_batch(host)
        else:
            batch = self.batches.prepare(scheduled)
        if fill is not None:
            fill.apply(batch.input_ids, scheduled)
        embeds = self.images.merge(scheduled, batch.input_ids) if has_images and self.images else None
        mrope, positions = self.mrope, batch.positions
        positions = positions if mrope is None else mrope.positions(scheduled, positions)  # Qwen-VL only
        hidden = self.model(batch.input_ids, positions, self.kv_caches, batch.ctx, embeds)
        if self._compiled_variants is not None:
            self._watch_compiles(len(batch.input_ids), len(scheduled))
        if batch.logits_indices.numel() == 0:
            return torch.empty((0, self.config.vocab_size))
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    @torch.inference_mode()
    def pool(self, scheduled: list[ScheduledSeq], pooler: Pooler) -> dict[int, torch.Tensor]:
        """Run one step of prompt chunks (--runner pooling); the pooled final hidden state ([H]
        float32) of each sequence whose prompt this step completes, by seq id."""
        batch = self.batches.prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.ctx)  # [T, H]
        spans: list[PoolSpan] = []
        row = 0
        for s in scheduled:
            end = s.start + s.num_new_tokens
            spans.append(
                PoolSpan(s.seq.seq_id, row, row + s.num_new_tokens, s.start, end >= s.seq.num_prompt_tokens)
            )
            row += s.num_new_tokens
        return pooler.pool(hidden, spans)

    def release(self, seq_id: int) -> None:
        """A sequence finished: drop what the runner keeps for it across steps."""
        self.batches.release(seq_id)
        if self.images is not None:
            self.images.release(seq_id)

    def close(self) -> None:
        """Free the weights, the KV cache, the decode graphs and this rank's process group: the
        engine is closed and steps no more (idempotent; ParallelRunner also stops its workers)."""
        if hasattr(self, "model"):
            self.model.decode_stack = None  # it holds the model and the cache: a cycle only gc frees
            self.decode_stack = None
            self.images = None  # it holds the model too
            del self.model
        self.kv_caches = []
        self.graphs = None
        self.tp = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the card's memory back for another engine or process

    def _gpu_kv_bytes(self) -> int:
        """What the card has left for the KV cache once a maximal step has run (logged)."""
        profile = profile_gpu_memory(
            TorchCudaMemory(self.device), self._run_maximal_step, self._memory_at_start
        )
        kv_bytes = gpu_kv_cache_bytes(profile, self.args.gpu_memory_utilization)
        logger.info(
            "%s; the KV cache gets %.2f GiB (--gpu-memory-utilization %s)",
            profile.describe(),
            kv_bytes / (1 << 30),
            self.args.gpu_memory_utilization,
        )
        return kv_bytes

    def _run_maximal_step(self) -> None:
        """One step as large as the scheduler allows (max_num_batched_tokens tokens over up to
        max_num_seqs sequences, each sampling with top_k, top_p and min_p), over a KV cache just
        big enough: the peak activation memory the KV cache must leave room for."""
        scheduled, num_blocks = maximal_step(self.args, self.max_model_len)
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.config.head_dim)
        self.kv_caches = allocate_kv_caches(self.config.num_layers, shape, self.kv_dtype, self.device)
        try:
            if self.is_pooling:  # no logits, no sampling
                self.pool(scheduled, Pooler("MEAN"))
                return
            logits = self.execute(scheduled)  # [num_seqs, V]; [0, V] on tensor-parallel ranks > 0
            if len(logits):  # sampling's temporaries too (top_p sorts: its costliest pass)
                sample_rows(logits, [PROFILED_SAMPLING] * len(logits), torch.Generator(logits.device), {})
        finally:
            for s in scheduled:
                self.release(s.seq.seq_id)
            del self.kv_caches  # the real cache is sized from this step's figures
