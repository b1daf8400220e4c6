"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3; Mixtral and Qwen3-MoE with the
experts of model/moe.py in place of the MLP; Gemma 3 with its norms, GELU and per-layer rotary:
config.GemmaMath) over a flattened token batch.

All sequences of a step are one [T, hidden] batch for every matmul; only attention is per sequence.
q/k/v and gate/up projections are fused at load time (fewer, larger matmuls); each fused parameter
knows how to load its shards from the checkpoint's separate tensors (Phi-3's come fused already).
Under tensor parallelism (`tp`, model/parallel.py) every size below is this rank's share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from corral_engine.model.attention import AttentionContext, paged_attention
from corral_engine.model.config import ModelConfig
from corral_engine.model.family_math import final_logits
from corral_engine.model.int4_ops import int4_linear, pack_for_kernel, unpack_nibbles
from corral_engine.model.moe import SparseMoeBlock
from corral_engine.model.native import FusedOps
from corral_engine.model.norm import NoNorm, RMSNorm
from corral_engine.model.parallel import TensorParallel, VocabParallelEmbedding
from corral_engine.model.quant_ops import WEIGHT_DTYPES, fp8_linear, int8_linear
from corral_engine.model.rotary import Rotary, rotated

if TYPE_CHECKING:
    from corral_engine.model.decode_stack import DecodeStack
    from corral_engine.model.native import AmxLinear
    from corral_engine.model.triton_ops import TritonOps  # imports triton: only where it is used


class Linear(nn.Linear):
    """nn.Linear that can multiply bfloat16 batches in float32: on CPUs without native bf16 matmuls
    (no AVX512-BF16 / AMX) PyTorch emulates them at a fraction of float32 speed, and upcasting the
    weight on every call is still 4-6x faster from about 8 rows on. The result is rounded back to
    bf16, so only float32 accumulation order differs. Fewer rows stay in bf16, through the native
    kernel where it built (`fused_ops`: 1.3-2x PyTorch's bf16 matmul there)."""

    upcast_min_rows = 0  # 0: never; set per model by the runner (ModelRunner.upcast_rows)
    kernel_rows = 0  # bf16 batches of fewer rows through `fused_ops` (MatmulPlan.kernel_rows)
    fused_ops: FusedOps | None = None  # the native small-batch kernel, where `kernel_rows`
    # (the runner sets it once per layer, only for a contiguous bf16 weight the kernel can read)
    packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (see prepack)
    packed_dtype: torch.dtype | None = None
    upcast_packed: torch.Tensor | None = None  # a float32 copy for upcast batches (see prepack_upcast)
    amx: AmxLinear | None = None  # the AMX kernel and the weight in its layout (see prepack_amx)
    amx_packed: torch.Tensor | None = None
    upcast_bias: torch.Tensor | None = None
    # "int8" or "fp8" once `quantize` made this a quantized layer: `weight` in that dtype and the
    # buffer `weight_scale` (float32 [out]); "int4": `weight` uint8 [out, in/2] (two values a
    # byte) with float32 `weight_scale` and `weight_zero` [out, in/group_size] until
    # quantized_ready packs them for the kernel; None: the plain layer above.
    quant: str | None = None
    kernel_scale: torch.Tensor | None = None  # weight_scale as the quantized matmul reads it
    group_size = 0  # int4: input columns per scale (and zero)
    kernel_group = 0  # int4: the kernel's group size (a divisor of group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self._quantized(x)
        if (self.kernel_rows or self.upcast_min_rows) and x.dtype == torch.bfloat16:
            rows = x.shape[0]
            if self.upcast_min_rows and rows >= self.upcast_min_rows:  # a CPU without native bf16
                if self.upcast_packed is not None and x.dim() == 2:
                    out = torch.ops.mkldnn._linear_pointwise(
                        x.float(), self.upcast_packed, self.upcast_bias, "none", [], ""
                    )
                    return out.to(x.dtype)
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
            ops = self.fused_ops  # set only where it can read this layer's weight
            if rows < self.kernel_rows and ops is not None and x.dim() == 2 and rows > 0 and ops.supports(x):
                return ops.linear_rows(x, self.weight, self.bias)
        if (
            self.amx is not None
            and self.amx_packed is not None
            and x.dim() == 2
            and x.dtype == torch.bfloat16
        ):
            return self.amx(x, self.amx_packed, self.bias, self.out_features)
        if self.packed is not None and x.dim() == 2 and x.dtype == self.packed_dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def quantize(self, kind: str, group_size: int = -1) -> None:
        """Hold the weight as `kind` ("int8", "fp8": a float32 scale per output row; "int4": a
        scale and zero per `group_size` inputs of a row; filled by the loader); called on the meta
        device, so no plain weight is ever allocated."""
        shape, device = self.weight.shape, self.weight.device
        if kind == "int4":
            self.group_size = shape[1] if group_size == -1 else group_size
            groups = (shape[0], shape[1] // self.group_size)
            self.weight = nn.Parameter(
                torch.empty((shape[0], shape[1] // 2), dtype=torch.uint8, device=device), requires_grad=False
            )
            self.register_buffer("weight_scale", torch.ones(groups, dtype=torch.float32, device=device))
            self.register_buffer("weight_zero", torch.zeros(groups, dtype=torch.float32, device=device))
            self.quant = kind
            return
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=WEIGHT_DTYPES[kind], device=device), requires_grad=False
        )
        self.register_buffer("weight_scale", torch.ones(shape[0], dtype=torch.float32, device=device))
        self.quant = kind

    def quantized_ready(self, dtype: torch.dtype) -> None:
        """After loading: the scales as the kernel reads them (int8: [out] in the activations'
        `dtype`; fp8: [1, out] float32; int4: the kernel's packed weight and scales_and_zeros)."""
        scale = self.get_buffer("weight_scale")
        if self.quant == "int4":
            packed, self.kernel_group, self.kernel_scale = pack_for_kernel(
                self.weight, scale, self.get_buffer("weight_zero"), self.group_size, dtype
            )
            self.weight = nn.Parameter(packed, requires_grad=False)
            del self.weight_scale, self.weight_zero  # now in kernel_scale
            return
        self.kernel_scale = scale.to(dtype) if self.quant == "int8" else scale.view(1, -1)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.kernel_scale
        if scale is None:
            raise RuntimeError("a quantized Linear ran before quantized_ready")
        if self.quant == "int8":
            return int8_linear(x, self.weight, scale, self.bias)
        if self.quant == "int4":
            return int4_linear(x, self.weight, self.kernel_group, scale, self.bias)
        return fp8_linear(x, self.weight, scale, self.bias)

    def unquantize(self, dtype: torch.dtype) -> None:
        """Make an int4 layer (before quantized_ready) plain again, in `dtype`, keeping the rows
        loaded so far: the loader's way out when a shard cannot stay int4 (act-order)."""
        group = torch.arange(self.in_features, device=self.weight.device) // self.group_size
        zero, scale = self.get_buffer("weight_zero")[:, group], self.get_buffer("weight_scale")[:, group]
        weight = (unpack_nibbles(self.weight).float() - zero) * scale
        del self.weight_scale, self.weight_zero
        self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.quant = None

    def prepack(self, keep_weight: bool) -> None:
        """Reorder the weight once into oneDNN's blocked layout, which F.linear would otherwise
        redo, or work around, on every call (CPU only). Without `keep_weight` the plain copy is
        released, so weight memory does not double; keep it when another module shares it."""
        self.packed_dtype = self.weight.dtype
        # The batch size is a layout hint; 64 measured best for batches of 1 to 64 (AVX2).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        if not keep_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def prepack_amx(self, kernel: AmxLinear, keep_weight: bool) -> bool:
        """Pack the weight once for the AMX kernel, which then multiplies this layer's bf16 batches
        (those the small-batch kernel does not take); False, and nothing changed, where the kernel
        does not take this weight (not bf16, a size not a multiple of 32, a bias of another dtype).
        `keep_weight` as in prepack."""
        bias_ok = self.bias is None or self.bias.dtype == torch.bfloat16
        if self.quant is not None or not bias_ok or not kernel.fits(self.weight):
            return False
        self.amx_packed = kernel.pack(self.weight)
        self.amx = kernel
        if not keep_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def prepack_upcast(self) -> None:
        """For a bf16 weight whose large batches are multiplied in float32 (`upcast_min_rows`): a
        float32 copy in oneDNN's layout, made once, instead of converting the weight on every call.
        The bf16 weight stays for small batches (which read half the bytes); the copy costs twice
        its memory."""
        self.upcast_packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().float(), 64)
        self.upcast_bias = None if self.bias is None else self.bias.detach().float()


class FusedLinear(Linear):
    """A linear layer whose output rows are several checkpoint tensors stacked (e.g. q, k, v)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size


class Attention(nn.Module):
    fused_ops: FusedOps | None = None  # the native bf16 ops, set by the runner where they built
    triton_ops: TritonOps | None = None  # the GPU's fused elementwise kernels, set by the runner

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_heads if tp is None else tp.plan.num_heads
        self.num_kv_heads = config.num_kv_heads if tp is None else tp.plan.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_windows[layer_idx]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, config.qkv_bias
        )
        # Row-parallel: each rank's partial sum is all-reduced; rank 0 alone adds the bias.
        has_bias = config.o_bias and (tp is None or tp.rank == 0)
        self.o_proj = Linear(q_size, config.hidden_size, bias=has_bias)
        is_gemma, family = config.gemma is not None, config.family
        # OLMo 2 norms q and k over the whole projection (all heads at once), in float32.
        self.is_whole_qk_norm = family is not None and family.is_post_norm
        q_dim, k_dim = (q_size, kv_size) if self.is_whole_qk_norm else (self.head_dim, self.head_dim)
        fp32, eps = self.is_whole_qk_norm, config.rms_norm_eps
        self.q_norm = RMSNorm(q_dim, eps, is_gemma, fp32) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dim, eps, is_gemma, fp32) if config.qk_norm else None
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.softcap = None if family is None else family.attn_logit_softcapping  # Gemma 2

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, R]: R = D, or fewer leading dims with partial rotary
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.is_whole_qk_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)
        elif self.q_norm is not None and self.k_norm is not None:
            if self.fused_ops is not None and q.dtype == torch.bfloat16:  # the native norm reads whole rows
                q, k = q.contiguous(), k.contiguous()
            q = self.q_norm(q)
            k = self.k_norm(k)
        ops = self.triton_ops
        fused = self.fused_ops
        dim = cos.shape[-1]  # partial rotary: the kernels rotate views of the leading dims in place
        if ops is not None and ops.supports(q) and ops.supports(k):
            ops.rotary(q[..., :dim], k[..., :dim], cos, sin)  # in place, one launch for both
        elif fused is not None and fused.supports_rotary(q, k, cos, sin):
            fused.rotary(q, k, cos, sin)  # bf16 on the CPU: in place, one call instead of twelve ops
        else:
            q, k = rotated(q, cos, sin), rotated(k, cos, sin)
        if ctx.unified is None and ctx.kv_write is None:  # those two read any row stride
            v = v.contiguous()
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], ctx, self.scale, self.window, self.softcap)
        out = self.o_proj(o.reshape(num_tokens, q_size))  # [T, hidden]
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    fused_ops: FusedOps | None = None  # the native bf16 ops, set by the runner where they built
    triton_ops: TritonOps | None = None  # the GPU's fused elementwise kernels, set by the runner

    def __init__(self, config: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.tp = tp
        size = config.intermediate_size if tp is None else tp.plan.intermediate_size
        self.gate_up_proj = FusedLinear(
            config.hidden_size, {"gate_proj": size, "up_proj": size}, config.mlp_bias
        )
        has_bias = config.mlp_bias and (tp is None or tp.rank == 0)
        self.down_proj = Linear(size, config.hidden_size, bias=has_bias)
        self.size = size
        self.is_gelu = config.hidden_act == "gelu_pytorch_tanh"  # Gemma; else SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        ops: FusedOps | TritonOps | None = self.fused_ops
        if self.triton_ops is not None:
            ops = self.triton_ops
        gate, up = gate_up[:, : self.size], gate_up[:, self.size :]
        if self.is_gelu:
            out = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        elif ops is not None and ops.supports(gate_up):  # one pass, not three
            out = self.down_proj(ops.silu_and_mul(gate_up))
        else:
            out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, tp)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(config, tp) if config.is_sparse_layer(layer_idx) else MLP(config, tp)
        )
        hidden, eps, is_gemma = config.hidden_size, config.rms_norm_eps, config.gemma is not None
        family = config.family
        is_post = family is not None and family.is_post_norm  # OLMo 2: no norm before a sublayer
        self.input_layernorm: RMSNorm | NoNorm = NoNorm() if is_post else RMSNorm(hidden, eps, is_gemma)
        self.post_attention_layernorm = RMSNorm(hidden, eps, is_gemma, is_post)
        # Gemma's "sandwich": the attention output is normed (post_attention_layernorm) before its
        # residual add, and the MLP has a norm on each side; OLMo 2's, after it only.
        has_post_mlp = is_gemma or is_post
        self.pre_feedforward_layernorm = (
            RMSNorm(hidden, eps, True) if is_gemma else NoNorm() if is_post else None
        )
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, is_gemma, True) if has_post_mlp else None
        # Granite scales each sublayer's output before its residual add.
        self.residual_multiplier = None if family is None else family.residual_multiplier
        self.rope_kind = config.rope_kinds[layer_idx] if config.rope_kinds else None

    def forward(self, x, residual, cos, sin, kv_cache, ctx):  # type: ignore[no-untyped-def]
        """(this layer's MLP output, the residual stream before it); the residual add after a
        sublayer is done by the next norm (`RMSNorm.add_forward`: one kernel on GPUs)."""
        if residual is None:  # the first layer
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, ctx)
        pre_mlp, post_mlp = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre_mlp is None or post_mlp is None:
            multiplier = self.residual_multiplier
            if multiplier is not None:  # Granite
                h, residual = self.post_attention_layernorm.add_forward(h * multiplier, residual)
                return self.mlp(h) * multiplier, residual
            h, residual = self.post_attention_layernorm.add_forward(h, residual)
            return self.mlp(h), residual
        h, residual = pre_mlp.add_forward(self.post_attention_layernorm(h), residual)
        return post_mlp(self.mlp(h)), residual


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        # A weight given, so no random init: built on the meta device, normal_ would run PyTorch's
        # Python reference and import torch._dynamo and triton (~2 s of every CPU engine's start).
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
            if tp is None
            else VocabParallelEmbedding(tp, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        is_post = config.family is not None and config.family.is_post_norm  # OLMo 2's float32 scale
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma is not None, is_post)
        self.embed_scale = None if config.gemma is None else config.gemma.embed_scale
        self.embedding_multiplier = None if config.family is None else config.family.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:  # Granite: a Python float, as transformers multiplies
            return x * self.embedding_multiplier
        if self.embed_scale is None:
            return x
        # Gemma multiplies by sqrt(hidden) rounded to the model dtype, as transformers does.
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)


class CausalLM(nn.Module):
    # Small decode batches' whole decoder in one native call, set by the runner where it runs
    # (model/decode_stack.py); the layers below compute the same bits.
    decode_stack: DecodeStack | None = None

    def __init__(
        self, config: ModelConfig, tp: TensorParallel | None = None, has_lm_head: bool = True
    ) -> None:
        """`has_lm_head` False: an embedding model's decoder alone (--runner pooling), whose
        checkpoint need not hold an LM head."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = Decoder(config, tp)
        # One table per rope parameter set (Gemma 3: its local and its global layers'), each
        # layer reading its own; the runner fills them once the engine's context is known.
        self.rotaries = nn.ModuleList(Rotary(config, kind) for kind in config.rope_kind_set)
        kinds = [r.kind for r in self.rotaries]
        self.layer_rotary = [kinds.index(layer.rope_kind) for layer in self.model.layers]
        vocab = config.vocab_size if tp is None else tp.plan.vocab_size
        self.lm_head: Linear | None = Linear(config.hidden_size, vocab, bias=False) if has_lm_head else None
        if self.lm_head is not None and config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ctx: AttentionContext,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: a step with images' merged rows
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rotaries = cast("list[Rotary]", list(self.rotaries))
        tables = [rotary.cos_sin(positions, x.dtype) for rotary in rotaries]  # each [T, 1, R]
        stack = self.decode_stack
        if stack is not None and stack.takes(x, ctx, kv_caches):
            cos, sin = tables[0]  # one table: the stack refuses per-layer rotary
            return stack(x, cos, sin, ctx)
        residual = None
        for layer, index, kv_cache in zip(self.model.layers, self.layer_rotary, kv_caches, strict=True):
            x, residual = layer(x, residual, *tables[index], kv_cache, ctx)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V] float32
        if self.lm_head is None:
            raise RuntimeError("an embedding model (--runner pooling) computes no logits")
        if self.tp is not None:  # each rank's vocabulary rows, gathered on rank 0 (empty elsewhere)
            return final_logits(self.tp.gather_logits(self.lm_head(hidden).float()), self.config.family)
        return final_logits(self.lm_head(hidden).float(), self.config.family)
