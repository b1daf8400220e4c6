"""The engine options of the model an engine loads and where it runs: the checkpoint and its name,
dtype, quantization and runner, the device and ranks, the attention kernels, and the KV cache's size
and dtype with the context length (light; no torch). `args.EngineArgs` adds the rest."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from corral_engine.options import Option, Vllm, option_field

DType = Literal["auto", "bfloat16", "float16", "float32"]
AttentionBackend = Literal["auto", "triton", "native", "sdpa"]
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "triton", "native", "sdpa")
DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS: tuple[str, ...] = ("fp8", "int8", "awq", "gptq", "compressed-tensors")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
RunnerChoice = Literal["auto", "generate", "pooling"]
RUNNERS: tuple[str, ...] = ("auto", "generate", "pooling")

DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # on CPU, 1 GiB when neither blocks nor bytes are given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

_MODEL_HELP = "a local checkpoint directory, hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or pvc://CLAIM/PATH"
_TP_HELP = "ranks (processes) the model is split across: a GPU each on CUDA, a share of the cores on CPU"


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The first of `EngineArgs`' options, in their declared order; not built on its own."""

    model: str = dataclasses.field(
        metadata={"option": Option(_MODEL_HELP, metavar="URI", vllm=Vllm("--model"))}
    )
    served_model_name: str | None = option_field(
        None,
        help="model name in the API",
        default_text="ORG/NAME for hf://, else the path's last component",
        metavar="NAME",
        vllm=Vllm("--served-model-name"),
    )
    dtype: DType = option_field(
        "auto",
        help="weights and KV dtype; auto: bfloat16 where the CPU multiplies it natively, else float32",
        choices=DTYPES,
        crd="dtype",
        vllm=Vllm("--dtype"),
    )
    quantization: str | None = option_field(
        None,
        help="quantize the attention and MLP weights at load, one scale per output row (embeddings, "
        "LM head and norms keep --dtype): int8 multiplies int8 weights on CPU (and on CUDA where "
        "PyTorch's kernel runs there, else dequantizes); fp8 runs fp8 weights and per-token fp8 "
        "activations on CUDA of compute capability 8.9+ (dequantized below it) and int8 on CPU. "
        "FP8 checkpoints load without it: fp8 on such GPUs, dequantized to --dtype elsewhere. awq, "
        "gptq, compressed-tensors only name the checkpoint's own format (int4 weight-only checkpoints "
        "load without it: int4 kernels for bfloat16 models, dequantized otherwise)",
        default_text="none: the checkpoint's own quantization_config decides",
        choices=QUANTIZATIONS,
        crd="quantization",
        vllm=Vllm("--quantization"),
    )
    device: str = option_field("auto", help="cpu, cuda, cuda:N", metavar="DEVICE")
    runner: RunnerChoice = option_field(
        "auto",
        help="generate text, or pool each prompt's hidden states into an embedding (/v1/embeddings); "
        "auto: pooling for a checkpoint whose architecture ends in Model, EmbeddingModel or "
        "ForTextEncoding (Qwen3-Embedding names Qwen3ForCausalLM: give pooling)",
        choices=RUNNERS,
        crd="runner",
        vllm=Vllm("--runner"),
    )
    pooler_config: str | None = option_field(
        None,
        help="with --runner pooling, a JSON object: pooling_type LAST, MEAN or CLS and normalize true "
        'or false, e.g. {"pooling_type": "MEAN"}; each key not given comes from the checkpoint\'s '
        "sentence-transformers files (modules.json), else LAST and normalized",
        default_text="the checkpoint's, else LAST, normalized",
        metavar="JSON",
        crd="poolerConfig",
        vllm=Vllm("--pooler-config"),
    )
    tensor_parallel_size: int = option_field(
        1, help=_TP_HELP, metavar="N", ge=1, le=64, vllm=Vllm("--tensor-parallel-size")
    )
    attention_backend: AttentionBackend = option_field(
        "auto",
        help="attention kernels: triton (paged, one launch a step; on CPU only under TRITON_INTERPRET=1), "
        "native (the C paged-decode kernel, CPU), sdpa (PyTorch's, the reference); auto: triton on "
        "CUDA, native on CPU where it builds, else sdpa",
        choices=ATTENTION_BACKENDS,
        crd="attentionBackend",
    )
    enforce_eager: bool = option_field(
        False,
        help="run every step eagerly: no CUDA graphs for decode batches",
        crd="enforceEager",
        vllm=Vllm("--enforce-eager"),
    )
    gpu_memory_utilization: float = option_field(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        help="share of the GPU's memory this engine may use: weights, a maximal step's activations "
        "and the KV cache, which gets the rest (CUDA only)",
        metavar="FRACTION",
        ge=0.05,
        le=1.0,
        crd="gpuMemoryUtilization",
        vllm=Vllm("--gpu-memory-utilization"),
    )
    block_size: int = option_field(
        DEFAULT_BLOCK_SIZE,
        help="tokens per KV block",
        metavar="N",
        ge=1,
        le=1024,
        is_power_of_two=True,
        crd="blockSize",
        vllm=Vllm("--block-size"),
    )
    num_kv_blocks: int | None = option_field(
        None,
        help="KV-cache size in blocks",
        default_text="from --kv-cache-memory",
        metavar="N",
        ge=1,
        crd="numKvBlocks",
        vllm=Vllm("--num-gpu-blocks-override"),
    )
    kv_cache_memory_bytes: int | None = option_field(
        None,
        help="KV-cache size in bytes, e.g. 512Mi or 4Gi",
        default_text="1Gi on CPU; on CUDA what --gpu-memory-utilization leaves",
        metavar="BYTES",
        ge=1,
        is_bytes=True,
        flag="--kv-cache-memory",
        crd="kvCacheMemory",
        vllm=Vllm("--kv-cache-memory-bytes"),
    )
    kv_cache_dtype: KvCacheDtype = option_field(
        "auto",
        help="KV-cache storage dtype: auto is the model's; fp8 (fp8_e4m3) or fp8_e5m2 store one byte a "
        "value, twice bf16's tokens in the same memory, cast with a scale of 1.0, saturating",
        choices=KV_CACHE_DTYPES,
        crd="kvCacheDtype",
        vllm=Vllm("--kv-cache-dtype"),
    )
    max_model_len: int | None = option_field(
        None,
        help="context window: prompt + output tokens",
        default_text="the model's",
        metavar="N",
        ge=1,
        crd="maxModelLen",
        vllm=Vllm("--max-model-len"),
    )
