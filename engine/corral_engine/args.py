"""Engine arguments: the one configuration object of a Corral engine, and the one declaration of
each engine option (light; no torch). The options of the model and where it runs are declared in
`model_args.ModelArgs`, which `EngineArgs` extends with the scheduling, serving, speculation and
LoRA ones.

Every `EngineArgs` field carries an `Option`: its help, bounds, CLI flag, CRD field and vLLM
equivalent. `corral engine`'s flags, the CRD's `spec.engine.args`, the operator's command lines
for both engine kinds and the docs' flag table are all derived from these declarations (read into
an option_table.py:OptionTable, which also checks the values).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

from corral_engine.lora import parse_lora_module
from corral_engine.model_args import ModelArgs
from corral_engine.option_table import OptionTable
from corral_engine.options import (
    BYTES_PATTERN,
    ArgumentError,
    AtMost,
    Exclusive,
    Option,
    Vllm,
    broken_rule,
    option_field,
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
KV_POLICIES: tuple[str, ...] = ("preempt", "reserve")
# corral_engine.server.tool_parsers.TOOL_PARSERS' names, restated here so this module needs no
# server import (tests/server/test_tool_parsers.py checks they agree).
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
# corral_engine.server.reasoning.REASONING_PARSERS' names, restated likewise.
ReasoningParser = Literal["deepseek_r1", "qwen3"]
REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024

# Rules over two options, checked by EngineArgs and (as CEL and pydantic checks) by the CRD.
RULES: tuple[Exclusive | AtMost, ...] = (
    Exclusive("num_kv_blocks", "kv_cache_memory_bytes"),
    AtMost("prompt_lookup_min", "prompt_lookup_max"),
    AtMost("max_loras", "max_cpu_loras", "a step's adapters are read from host memory"),
)


@dataclass(frozen=True, slots=True)
class EngineArgs(ModelArgs):
    max_num_seqs: int = option_field(
        DEFAULT_MAX_NUM_SEQS,
        help="sequences per step",
        metavar="N",
        ge=1,
        le=4096,
        crd="maxNumSeqs",
        vllm=Vllm("--max-num-seqs"),
    )
    max_num_batched_tokens: int = option_field(
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="token budget per step",
        metavar="N",
        ge=1,
        le=1 << 20,
        crd="maxNumBatchedTokens",
        vllm=Vllm("--max-num-batched-tokens"),
    )
    kv_policy: KvPolicy = option_field(
        "preempt",
        help="on KV pressure: preempt the newest sequence, or admit only what fits",
        choices=KV_POLICIES,
        crd="kvPolicy",
    )
    enable_prefix_caching: bool = option_field(
        True,
        help="reuse the KV blocks of shared prefixes",
        flag="--no-prefix-caching",
        crd="enablePrefixCaching",
        vllm=Vllm("--enable-prefix-caching"),
    )
    max_waiting: int | None = option_field(
        None,
        help="requests held that will not run at the next step (beyond the running batch's free seats) "
        "before new ones get 429; a request's prompts are admitted together",
        default_text="unbounded",
        metavar="N",
        ge=0,
        crd="maxWaiting",
    )
    max_images_per_prompt: int = option_field(
        999,
        help="images one prompt may carry (a chat request's image parts, an offline prompt's "
        "multi_modal_data); more are refused with 400; 0 refuses images",
        metavar="N",
        ge=0,
        crd="maxImagesPerPrompt",
        vllm=Vllm("--limit-mm-per-prompt", "image"),
    )
    allowed_media_domains: tuple[str, ...] | None = option_field(
        None,
        help="the hosts an image's http(s) URL may name, its redirects' too (e.g. images.example.com); "
        "a URL of any other host is refused with 400 before it is fetched; data: URLs are always taken",
        default_text="any host, as vLLM's default",
        metavar="HOST",
        crd="allowedMediaDomains",
        vllm=Vllm("--allowed-media-domains"),
    )
    stream_interval: int = option_field(
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
    tool_call_parser: ToolCallParser | None = option_field(
        None,
        help="read tool calls out of replies in this format, which turns on tool_choice auto "
        "(hermes: tool_call tags, Hermes and Qwen 2.5/3; llama3_json: Llama 3.1+ JSON calls; "
        "mistral: [TOOL_CALLS], Mistral and Mixtral; pythonic: a Python list of calls, Llama 3.2/4 "
        "and ToolACE; qwen3_coder: <function=...> XML, Qwen3-Coder)",
        default_text="none: auto is refused; required and named tool choices work without it",
        choices=TOOL_CALL_PARSERS,
        crd="toolCallParser",
        vllm=Vllm("--tool-call-parser", also=("--enable-auto-tool-choice",)),
    )
    reasoning_parser: ReasoningParser | None = option_field(
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
    chat_template: str | None = option_field(
        None,
        help="the chat template for chat requests and /tokenize's messages: a file, or the Jinja "
        "template itself (a value holding {, } or a newline)",
        default_text="the tokenizer's; a model without one refuses chat requests",
        metavar="TEMPLATE",
        crd="chatTemplate",
        vllm=Vllm("--chat-template"),
    )
    seed: int = option_field(0, help="engine seed for unseeded sampling", metavar="N", vllm=Vllm("--seed"))
    num_threads: int | None = option_field(
        None, help="torch CPU threads", default_text="all cores", metavar="N", ge=1
    )
    speculative: Literal["ngram"] | None = option_field(
        None,
        help="speculative decoding for greedy requests: ngram drafts from the request's own tokens",
        default_text="off",
        choices=("ngram",),
        crd="speculative.method",
        crd_default="ngram",
        vllm=Vllm("--speculative-config", "method"),
    )
    num_speculative_tokens: int = option_field(
        4,
        help="draft tokens verified per step when speculating",
        metavar="K",
        ge=1,
        le=16,
        crd="speculative.numSpeculativeTokens",
        crd_default=4,
        vllm=Vllm("--speculative-config", "num_speculative_tokens"),
    )
    prompt_lookup_min: int = option_field(
        2,
        help="shortest recurring n-gram that proposes drafts",
        metavar="N",
        ge=1,
        le=16,
        crd="speculative.promptLookupMin",
        vllm=Vllm("--speculative-config", "prompt_lookup_min"),
    )
    prompt_lookup_max: int = option_field(
        3,
        help="longest n-gram, tried first",
        metavar="N",
        ge=1,
        le=16,
        crd="speculative.promptLookupMax",
        vllm=Vllm("--speculative-config", "prompt_lookup_max"),
    )

    enable_lora: bool = option_field(
        False,
        help="serve LoRA adapters: --lora-modules at start, or loaded at run time (dense models; "
        "CUDA decode graphs and the native decode stack run only steps without an adapter)",
        vllm=Vllm("--enable-lora"),
    )
    lora_modules: tuple[str, ...] | None = option_field(
        None,
        help="LoRA adapters to serve, each NAME=PATH (a PEFT adapter directory) or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; needs --enable-lora',
        default_text="none",
        metavar="NAME=PATH",
        vllm=Vllm("--lora-modules"),
    )
    max_loras: int = option_field(
        4,
        help="distinct LoRA adapters one step may run (device slots); requests of others wait",
        metavar="N",
        ge=1,
        le=256,
        crd="maxLoras",
        vllm=Vllm("--max-loras"),
    )
    max_lora_rank: int = option_field(
        16,
        help="largest LoRA rank served; an adapter of a larger rank is refused",
        metavar="R",
        ge=1,
        le=1024,
        crd="maxLoraRank",
        vllm=Vllm("--max-lora-rank"),
    )
    max_cpu_loras: int | None = option_field(
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
