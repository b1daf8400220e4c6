"""Engine arguments: the one configuration object of a Corral engine, and the one declaration of
each engine option (light; no torch).

Every `EngineArgs` field carries an `Option`: its help, bounds, CLI flag, CRD field and vLLM
equivalent. `corral engine`'s flags, the CRD's `spec.engine.args`, the operator's command lines
for both engine kinds and the docs' flag table are all derived from these declarations (read into
an option_table.py:OptionTable, which also checks the values).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from corral_engine.lora import parse_lora_module
from corral_engine.option_table import OptionTable
from corral_engine.options import (
    BYTES_PATTERN,
    ArgumentError,
    AtMost,
    Exclusive,
    Option,
    Vllm,
    broken_rule,
    parse_bytes,
)
from corral_engine.pooling import parse_pooler_config

__all__ = [
    "BYTES_PATTERN",
    "DEFAULTS",
    "OPTIONS",
    "REASONING_PARSERS",
    "RULES",
    "TOOL_CALL_PARSERS",
    "ArgumentError",
    "AtMost",
    "EngineArgs",
    "Exclusive",
    "Option",
    "Vllm",
    "broken_rule",
    "cli_flag",
    "default_text",
    "is_list",
    "parse_bytes",
    "value_type",
]

KvPolicy = Literal["preempt", "reserve"]
DType = Literal["auto", "bfloat16", "float16", "float32"]
AttentionBackend = Literal["auto", "triton", "native", "sdpa"]
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_POLICIES: tuple[str, ...] = ("preempt", "reserve")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "triton", "native", "sdpa")
DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS: tuple[str, ...] = ("fp8", "int8", "awq", "gptq", "compressed-tensors")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
RunnerChoice = Literal["auto", "generate", "pooling"]
RUNNERS: tuple[str, ...] = ("auto", "generate", "pooling")
# corral_engine.server.tool_parsers.TOOL_PARSERS' names, restated here so this module needs no
# server import (tests/server/test_tool_parsers.py checks they agree).
ToolCallParser = Literal["hermes", "llama3_json", "mistral"]
TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "mistral")
# corral_engine.server.reasoning.REASONING_PARSERS' names, restated likewise.
ReasoningParser = Literal["deepseek_r1", "qwen3"]
REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # on CPU, 1 GiB when neither blocks nor bytes are given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# Rules over two options, checked by EngineArgs and (as CEL and pydantic checks) by the CRD.
RULES: tuple[Exclusive | AtMost, ...] = (
    Exclusive("num_kv_blocks", "kv_cache_memory_bytes"),
    AtMost("prompt_lookup_min", "prompt_lookup_max"),
    AtMost("max_loras", "max_cpu_loras", "a step's adapters are read from host memory"),
)

_MODEL_HELP = "a local checkpoint directory, hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or pvc://CLAIM/PATH"
_TP_HELP = "ranks (processes) the model is split across: a GPU each on CUDA, a share of the cores on CPU"


def _option(default: object, **declared: Any) -> Any:
    return dataclasses.field(default=default, metadata={"option": Option(**declared)})


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model: str = dataclasses.field(
        metadata={"option": Option(_MODEL_HELP, metavar="URI", vllm=Vllm("--model"))}
    )
    served_model_name: str | None = _option(
        None,
        help="model name in the API",
        default_text="ORG/NAME for hf://, else the path's last component",
        metavar="NAME",
        vllm=Vllm("--served-model-name"),
    )
    dtype: DType = _option(
        "auto",
        help="weights and KV dtype; auto: bfloat16 where the CPU multiplies it natively, else float32",
        choices=DTYPES,
        crd="dtype",
        vllm=Vllm("--dtype"),
    )
    quantization: str | None = _option(
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
    device: str = _option("auto", help="cpu, cuda, cuda:N", metavar="DEVICE")
    runner: RunnerChoice = _option(
        "auto",
        help="generate text, or pool each prompt's hidden states into an embedding (/v1/embeddings); "
        "auto: pooling for a checkpoint whose architecture ends in Model, EmbeddingModel or "
        "ForTextEncoding (Qwen3-Embedding names Qwen3ForCausalLM: give pooling)",
        choices=RUNNERS,
        crd="runner",
        vllm=Vllm("--runner"),
    )
    pooler_config: str | None = _option(
        None,
        help="with --runner pooling, a JSON object: pooling_type LAST, MEAN or CLS and normalize true "
        'or false, e.g. {"pooling_type": "MEAN"}; each key not given comes from the checkpoint\'s '
        "sentence-transformers files (modules.json), else LAST and normalized",
        default_text="the checkpoint's, else LAST, normalized",
        metavar="JSON",
        crd="poolerConfig",
        vllm=Vllm("--pooler-config"),
    )
    tensor_parallel_size: int = _option(
        1, help=_TP_HELP, metavar="N", ge=1, le=64, vllm=Vllm("--tensor-parallel-size")
    )
    attention_backend: AttentionBackend = _option(
        "auto",
        help="attention kernels: triton (paged, one launch a step; on CPU only under TRITON_INTERPRET=1), "
        "native (the C paged-decode kernel, CPU), sdpa (PyTorch's, the reference); auto: triton on "
        "CUDA, native on CPU where it builds, else sdpa",
        choices=ATTENTION_BACKENDS,
        crd="attentionBackend",
    )
    enforce_eager: bool = _option(
        False,
        help="run every step eagerly: no CUDA graphs for decode batches",
        crd="enforceEager",
        vllm=Vllm("--enforce-eager"),
    )
    gpu_memory_utilization: float = _option(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        help="share of the GPU's memory this engine may use: weights, a maximal step's activations "
        "and the KV cache, which gets the rest (CUDA only)",
        metavar="FRACTION",
        ge=0.05,
        le=1.0,
        crd="gpuMemoryUtilization",
        vllm=Vllm("--gpu-memory-utilization"),
    )
    block_size: int = _option(
        DEFAULT_BLOCK_SIZE,
        help="tokens per KV block",
        metavar="N",
        ge=1,
        le=1024,
        is_power_of_two=True,
        crd="blockSize",
        vllm=Vllm("--block-size"),
    )
    num_kv_blocks: int | None = _option(
        None,
        help="KV-cache size in blocks",
        default_text="from --kv-cache-memory",
        metavar="N",
        ge=1,
        crd="numKvBlocks",
        vllm=Vllm("--num-gpu-blocks-override"),
    )
    kv_cache_memory_bytes: int | None = _option(
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
    kv_cache_dtype: KvCacheDtype = _option(
        "auto",
        help="KV-cache storage dtype: auto is the model's; fp8 (fp8_e4m3) or fp8_e5m2 store one byte a "
        "value, twice bf16's tokens in the same memory, cast with a scale of 1.0, saturating",
        choices=KV_CACHE_DTYPES,
        crd="kvCacheDtype",
        vllm=Vllm("--kv-cache-dtype"),
    )
    max_model_len: int | None = _option(
        None,
        help="context window: prompt + output tokens",
        default_text="the model's",
        metavar="N",
        ge=1,
        crd="maxModelLen",
        vllm=Vllm("--max-model-len"),
    )
    max_num_seqs: int = _option(
        DEFAULT_MAX_NUM_SEQS,
        help="sequences per step",
        metavar="N",
        ge=1,
        le=4096,
        crd="maxNumSeqs",
        vllm=Vllm("--max-num-seqs"),
    )
    max_num_batched_tokens: int = _option(
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="token budget per step",
        metavar="N",
        ge=1,
        le=1 << 20,
        crd="maxNumBatchedTokens",
        vllm=Vllm("--max-num-batched-tokens"),
    )
    kv_policy: KvPolicy = _option(
        "preempt",
        help="on KV pressure: preempt the newest sequence, or admit only what fits",
        choices=KV_POLICIES,
        crd="kvPolicy",
    )
    enable_prefix_caching: bool = _option(
        True,
        help="reuse the KV blocks of shared prefixes",
        flag="--no-prefix-caching",
        crd="enablePrefixCaching",
        vllm=Vllm("--enable-prefix-caching"),
    )
    max_waiting: int | None = _option(
        None,
        help="requests held that will not run at the next step (beyond the running batch's free seats) "
        "before new ones get 429; a request's prompts are admitted together",
        default_text="unbounded",
        metavar="N",
        ge=0,
        crd="maxWaiting",
    )
    max_images_per_prompt: int = _option(
        999,
        help="images one prompt may carry (a chat request's image parts, an offline prompt's "
        "multi_modal_data); more are refused with 400; 0 refuses images",
        metavar="N",
        ge=0,
        crd="maxImagesPerPrompt",
        vllm=Vllm("--limit-mm-per-prompt", "image"),
    )
    allowed_media_domains: tuple[str, ...] | None = _option(
        None,
        help="the hosts an image's http(s) URL may name, its redirects' too (e.g. images.example.com); "
        "a URL of any other host is refused with 400 before it is fetched; data: URLs are always taken",
        default_text="any host, as vLLM's default",
        metavar="HOST",
        vllm=Vllm("--allowed-media-domains"),
    )
    stream_interval: int = _option(
        1,
        help="output tokens a streamed request gathers into one event: 1 sends each token as it is "
        "sampled; more cut the host's work per token under high concurrency (a request's first "
        "token and its last are sent at once)",
        metavar="N",
        ge=1,
        le=1024,
        crd="streamInterval",
        vllm=Vllm("--stream-interval"),
    )
    tool_call_parser: ToolCallParser | None = _option(
        None,
        help="read tool calls out of replies in this format, which turns on tool_choice auto "
        "(hermes: tool_call tags, Hermes and Qwen 2.5/3; llama3_json: Llama 3.1+ JSON calls; "
        "mistral: [TOOL_CALLS], Mistral and Mixtral)",
        default_text="none: auto is refused; required and named tool choices work without it",
        choices=TOOL_CALL_PARSERS,
        crd="toolCallParser",
        vllm=Vllm("--tool-call-parser", also=("--enable-auto-tool-choice",)),
    )
    reasoning_parser: ReasoningParser | None = _option(
        None,
        help="move the think block a reasoning model writes before its answer to the chat reply's "
        "reasoning (and reasoning_content); tool calls and structured outputs apply to the answer "
        "(qwen3: a reply with no block is content; deepseek_r1: a reply is reasoning until the "
        "block's end tag)",
        default_text="none: the block stays in content",
        choices=REASONING_PARSERS,
        crd="reasoningParser",
        vllm=Vllm("--reasoning-parser"),
    )
    chat_template: str | None = _option(
        None,
        help="the chat template for chat requests and /tokenize's messages: a file, or the Jinja "
        "template itself (a value holding {, } or a newline)",
        default_text="the tokenizer's; a model without one refuses chat requests",
        metavar="TEMPLATE",
        crd="chatTemplate",
        vllm=Vllm("--chat-template"),
    )
    seed: int = _option(0, help="engine seed for unseeded sampling", metavar="N", vllm=Vllm("--seed"))
    num_threads: int | None = _option(
        None, help="torch CPU threads", default_text="all cores", metavar="N", ge=1
    )
    speculative: Literal["ngram"] | None = _option(
        None,
        help="speculative decoding for greedy requests: ngram drafts from the request's own tokens",
        default_text="off",
        choices=("ngram",),
        crd="speculative.method",
        crd_default="ngram",
        vllm=Vllm("--speculative-config", "method"),
    )
    num_speculative_tokens: int = _option(
        4,
        help="draft tokens verified per step when speculating",
        metavar="K",
        ge=1,
        le=16,
        crd="speculative.numSpeculativeTokens",
        crd_default=4,
        vllm=Vllm("--speculative-config", "num_speculative_tokens"),
    )
    prompt_lookup_min: int = _option(
        2,
        help="shortest recurring n-gram that proposes drafts",
        metavar="N",
        ge=1,
        le=16,
        crd="speculative.promptLookupMin",
        vllm=Vllm("--speculative-config", "prompt_lookup_min"),
    )
    prompt_lookup_max: int = _option(
        3,
        help="longest n-gram, tried first",
        metavar="N",
        ge=1,
        le=16,
        crd="speculative.promptLookupMax",
        vllm=Vllm("--speculative-config", "prompt_lookup_max"),
    )

    enable_lora: bool = _option(
        False,
        help="serve LoRA adapters: --lora-modules at start, or loaded at run time (dense models; "
        "CUDA decode graphs and the native decode stack run only steps without an adapter)",
        vllm=Vllm("--enable-lora"),
    )
    lora_modules: tuple[str, ...] | None = _option(
        None,
        help="LoRA adapters to serve, each NAME=PATH (a PEFT adapter directory) or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; needs --enable-lora',
        default_text="none",
        metavar="NAME=PATH",
        vllm=Vllm("--lora-modules"),
    )
    max_loras: int = _option(
        4,
        help="distinct LoRA adapters one step may run (device slots); requests of others wait",
        metavar="N",
        ge=1,
        le=256,
        crd="maxLoras",
        vllm=Vllm("--max-loras"),
    )
    max_lora_rank: int = _option(
        16,
        help="largest LoRA rank served; an adapter of a larger rank is refused",
        metavar="R",
        ge=1,
        le=1024,
        crd="maxLoraRank",
        vllm=Vllm("--max-lora-rank"),
    )
    max_cpu_loras: int | None = _option(
        None,
        help="LoRA adapters whose weights are kept in host memory, least recently used dropped "
        "first; a request for a dropped one reads it again from its path",
        default_text="--max-loras",
        metavar="N",
        ge=1,
        le=65536,
        crd="maxCpuLoras",
        vllm=Vllm("--max-cpu-loras"),
    )

    def __post_init__(self) -> None:
        self._conform_types()
        self.validate()

    def _conform_types(self) -> None:
        """Each value checked against its field's annotation (numbers made Python's own, a path
        object a str), so a wrong type is refused here, naming the option, not deep in the engine."""
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        _TABLE.conform(self)

    def validate(self) -> None:
        _TABLE.check(self, RULES)
        self._validate_lora()
        if self.pooler_config is not None:
            parse_pooler_config(self.pooler_config)  # ArgumentError naming the bad key or value

    def _validate_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ArgumentError("lora_modules needs enable_lora (--enable-lora), as in vLLM")
        names: set[str] = set()
        for item in self.lora_modules or ():
            try:
                name, _, _ = parse_lora_module(item)
            except ValueError as e:
                raise ArgumentError(str(e)) from None
            if name in names:
                raise ArgumentError(f"lora_modules names adapter {name!r} twice")
            names.add(name)

    def replace(self, **changes: object) -> EngineArgs:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_cli_args(self) -> list[str]:
        """Render as `corral engine` flags; defaults are omitted so the engine's defaults apply."""
        return _TABLE.cli_args(self)


# Read once from the declarations above; the lookups are the table's, by option name.
_TABLE = OptionTable(EngineArgs)
OPTIONS: dict[str, Option] = _TABLE.options
DEFAULTS: dict[str, object] = _TABLE.defaults
cli_flag = _TABLE.cli_flag
default_text = _TABLE.default_text
value_type = _TABLE.value_type
is_list = _TABLE.is_list
