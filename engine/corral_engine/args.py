"""Engine arguments: the one configuration object of a Corral engine (light; no torch).

Built once at the edge (CLI flags, the operator's CR spec) and passed down, never mutated.
The operator renders these into `corral engine` flags with `to_cli_args`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

KvPolicy = Literal["preempt", "reserve"]
DType = Literal["auto", "bfloat16", "float16", "float32"]
KV_POLICIES: tuple[str, ...] = ("preempt", "reserve")
DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32")

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # 1 GiB when neither blocks nor bytes are given


class ArgumentError(ValueError):
    """An engine argument is invalid; the message names the argument and the allowed values."""


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model: str
    served_model_name: str | None = None
    dtype: DType = "auto"
    device: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_policy: KvPolicy = "preempt"
    enable_prefix_caching: bool = True
    max_waiting: int | None = None
    seed: int = 0
    num_threads: int | None = None
    speculative: Literal["ngram"] | None = None  # n-gram (prompt lookup) proposals, off by default
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # shortest n-gram that may propose drafts (vLLM's name; = core.ngram's)
    prompt_lookup_max: int = 3  # longest n-gram, tried first

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ArgumentError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ArgumentError("give either num_kv_blocks or kv_cache_memory_bytes, not both")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ArgumentError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ArgumentError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ArgumentError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ArgumentError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ArgumentError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_policy not in KV_POLICIES:
            raise ArgumentError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        if self.dtype not in DTYPES:
            raise ArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ArgumentError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.speculative not in (None, "ngram"):
            raise ArgumentError(f"speculative must be 'ngram' or unset, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ArgumentError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ArgumentError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ArgumentError(f"num_threads must be >= 1, got {self.num_threads}")

    def replace(self, **changes: object) -> EngineArgs:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_cli_args(self) -> list[str]:
        """Render as `corral engine` flags; defaults are omitted so the engine's defaults apply."""
        out = ["--model", self.model]
        defaults = EngineArgs(model=self.model)
        for field in dataclasses.fields(self):
            name = field.name
            value = getattr(self, name)
            if name == "model" or value == getattr(defaults, name) or value is None:
                continue
            if name == "enable_prefix_caching":
                out.append("--no-prefix-caching")
                continue
            flag = "--kv-cache-memory" if name == "kv_cache_memory_bytes" else "--" + name.replace("_", "-")
            out += [flag, str(value)]
        return out
