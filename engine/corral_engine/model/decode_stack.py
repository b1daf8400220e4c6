"""The whole decoder for a small batch of decodes in one native call (kernels/decode_stack.c).

At batch 1 a decode step's matmuls are a few milliseconds of memory-bound work, and the Python
around them (module calls, views, argument checks, allocations: ~100 calls a layer) adds about a
quarter. `DecodeStack` runs every layer from the embeddings to the final norm in C, through the same
native kernels in the same order as the PyTorch-level path takes for batches under `max_rows`
(`Linear.kernel_rows`), so its output is the same bits; it takes a step only when that path would
have run those kernels: bf16 on the CPU, no tensor parallelism, every row a decode of its own
sequence, the native paged decode and KV write in use.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from corral_engine.model.attention import AttentionContext
from corral_engine.model.native import MAX_BLOCK_SIZE, NativeKernelError

if TYPE_CHECKING:
    from corral_engine.model.llama import MLP, CausalLM, DecoderLayer, Linear
    from corral_engine.model.norm import RMSNorm

_ptr = ctypes.c_void_p


# Mirrors of DecodeLayer and DecodeStack in kernels/decode_stack.c, field for field.
_LAYER_POINTERS = [
    "input_norm",
    "post_norm",
    "qkv",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "o",
    "o_bias",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
    "k_cache",
    "v_cache",
]
_STACK_SIZES = [
    "num_layers",
    "hidden",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate",
    "block_size",
    "num_slots",
]


_Fields = tuple[tuple[str, Any], ...]


class _Layer(ctypes.Structure):
    _fields_: ClassVar[_Fields] = (*((name, _ptr) for name in _LAYER_POINTERS), ("window", ctypes.c_int64))


class _Stack(ctypes.Structure):
    _fields_: ClassVar[_Fields] = (
        *((name, ctypes.c_int64) for name in _STACK_SIZES),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("final_norm", _ptr),
        ("layers", ctypes.POINTER(_Layer)),
    )


class DecodeStack:
    """`model`'s decoder over `kv_caches` for decode batches of fewer than `max_rows` rows."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_rows: int,
    ) -> None:
        problem = unsupported(model, kv_caches)
        if problem:
            raise NativeKernelError(f"the native decode stack does not take this model: {problem}")
        self._fn = lib.decode_stack_bf16
        self._fn.restype = ctypes.c_int
        # stack; x, out; rows; cos, sin, slots, block tables; max blocks; context lengths; threads
        args: list[Any] = [ctypes.POINTER(_Stack), _ptr, _ptr, ctypes.c_int64, *[_ptr] * 4]
        self._fn.argtypes = [*args, ctypes.c_int64, _ptr, ctypes.c_int]
        self.max_rows = max_rows
        self.kv_caches = kv_caches
        config = model.config
        layers = _layers(model)
        self._layers = (_Layer * len(layers))()
        for entry, layer, (k_cache, v_cache) in zip(self._layers, layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, _mlp(layer)
            # An RMSNorm: OLMo 2's pass-through input norm never gets here (`unsupported`).
            entry.input_norm = cast("RMSNorm", layer.input_layernorm).weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv, entry.qkv_bias = _weights(attn.qkv_proj)
            if attn.q_norm is not None and attn.k_norm is not None:
                entry.q_norm, entry.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
            entry.o, entry.o_bias = _weights(attn.o_proj)
            entry.gate_up, entry.gate_up_bias = _weights(mlp.gate_up_proj)
            entry.down, entry.down_bias = _weights(mlp.down_proj)
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            entry.window = attn.window or 0
        k_cache = kv_caches[0][0]
        self._stack = _Stack(
            num_layers=len(layers),
            hidden=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            block_size=k_cache.shape[1],
            num_slots=k_cache.shape[0] * k_cache.shape[1],
            eps=model.model.norm.eps,
            scale=config.head_dim**-0.5,
            final_norm=model.model.norm.weight.data_ptr(),
            layers=self._layers,
        )
        self._model = model  # keeps every pointer above alive

    def takes(self, x: torch.Tensor, ctx: AttentionContext, kv_caches: object) -> bool:
        """Whether this step is one the stack runs: few rows, each a decode (of its own sequence
        or a draft), over the caches it was built for."""
        return (
            0 < x.shape[0] < self.max_rows
            and kv_caches is self.kv_caches
            and not ctx.seqs
            and len(ctx.decodes) == 1
            and ctx.decode_kernel is not None
            and ctx.kv_write is not None
            and ctx.unified is None
        )

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """x [R, hidden] (the embeddings), cos and sin [R, 1, D] -> the final norm's output."""
        batch = ctx.decodes[0]
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        tables = batch.block_tables.contiguous()
        out = torch.empty_like(x)
        failed = self._fn(
            ctypes.byref(self._stack), x.data_ptr(), out.data_ptr(), x.shape[0], cos.data_ptr(),
            sin.data_ptr(), ctx.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
            batch.ctx_lens.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed == 2:
            raise NativeKernelError("decode stack: a KV slot past the cache")
        if failed:
            raise NativeKernelError("decode stack: a scratch buffer could not be allocated")
        return out


def unsupported(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Why the stack cannot run `model` (empty: it can)."""
    if model.tp is not None:
        return "tensor parallelism"
    config = model.config
    if config.is_moe:  # the C decoder runs one dense MLP a layer; it has no router or experts
        return "mixture-of-experts layers"
    if config.gemma is not None:  # (1 + w) float32 norms, four a layer, GELU, per-layer rotary
        return "Gemma 3's layers (its norms, GELU MLP and per-layer rotary tables)"
    if config.family is not None:  # model/family_math.py: multipliers, post-norms, soft-capping
        return f"{config.architecture}'s layers"
    if config.rotary_dim is not None:
        return "partial rotary embeddings"
    if config.hidden_act != "silu" or config.attention_scale is not None:
        return "an MLP activation other than SiLU or an attention scale other than head_dim ** -0.5"
    if any(lin.quant is not None for layer in _layers(model) for lin in _linears(layer)):
        return "quantized Linear layers (int8, fp8 or int4 weights)"
    params = [p for p in model.parameters() if p.numel()]
    if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for p in params):
        return "weights other than bf16 on the CPU"
    linears = [lin for layer in _layers(model) for lin in _linears(layer)]
    if any(not lin.weight.is_contiguous() or lin.weight.numel() == 0 for lin in linears):
        return "a Linear without its plain contiguous weight"
    if not kv_caches or any(
        c.dtype != torch.bfloat16 or not c.is_contiguous() for pair in kv_caches for c in pair
    ):
        return "a KV cache that is not contiguous bf16"
    if kv_caches[0][0].shape[1] > MAX_BLOCK_SIZE:
        return f"blocks over {MAX_BLOCK_SIZE} tokens"
    return ""


def _layers(model: CausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.model.layers))


def _mlp(layer: DecoderLayer) -> MLP:
    """The layer's dense MLP: a model with experts never gets here (`unsupported`)."""
    return cast("MLP", layer.mlp)


def _linears(layer: DecoderLayer) -> tuple[Linear, ...]:
    attn, mlp = layer.self_attn, _mlp(layer)
    return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def _weights(linear: Linear) -> tuple[int, int | None]:
    return linear.weight.data_ptr(), None if linear.bias is None else linear.bias.data_ptr()
