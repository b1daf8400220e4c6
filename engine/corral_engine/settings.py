"""Engine settings from the environment, read in this one place and passed down: the `CORRAL_*`
switches that choose kernels and weight layouts (fallbacks and A/B knobs, not engine arguments), and
the model sources' cache and credentials (`SourceSettings`).

Light (no torch). `EngineSettings()` reads the environment once; `LLMEngine` builds it when not
given one, and `corral engine` builds it at start-up and logs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

# "auto": the engine decides from the machine it runs on; "1" forces the behaviour on; "0" off.
Switch = Literal["auto", "1", "0"]


class EngineSettings(BaseSettings):
    """The switches, with the environment variable each comes from."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    # CORRAL_NATIVE_ATTENTION=0: no native C kernels (paged decode attention, fused bf16 ops);
    # the PyTorch path computes the same thing.
    native_kernels: bool = Field(default=True, validation_alias="CORRAL_NATIVE_ATTENTION")
    # CORRAL_BATCHED_DECODE=0: decodes attend one sequence at a time (for comparison).
    batched_decode: bool = Field(default=True, validation_alias="CORRAL_BATCHED_DECODE")
    # CORRAL_PREPACK: Linear weights prepacked for oneDNN on CPU (model/matmul_plan.py).
    prepack: Switch = Field(default="auto", validation_alias="CORRAL_PREPACK")
    # CORRAL_BF16_UPCAST: bf16 matmuls of 8+ rows run in float32 where the CPU has no native bf16.
    bf16_upcast: Switch = Field(default="auto", validation_alias="CORRAL_BF16_UPCAST")
    # CORRAL_SMALL_BATCH_KERNEL: bf16 matmuls of fewer than 8 rows (batch-1 decode) through Corral's
    # native kernel instead of PyTorch/oneDNN; auto: where the CPU has no native bf16 (1.2-1.6x
    # there); 1: also where it has (keeps each plain bf16 weight beside the packed one: an A/B).
    small_batch_kernel: Switch = Field(default="auto", validation_alias="CORRAL_SMALL_BATCH_KERNEL")
    # CORRAL_AMX_LINEAR: bf16 Linear layers through Corral's AMX kernel (kernels/amx_linear.c)
    # instead of oneDNN where the CPU has AMX tiles; auto/1: there, 0: never (an A/B).
    amx_linear: Switch = Field(default="auto", validation_alias="CORRAL_AMX_LINEAR")
    # CORRAL_LORA_UPCAST: LoRA adapter slots in float32 for a bf16 model; auto: where bf16 matmuls
    # are upcast (a CPU without native bf16), 1: always, 0: slots in the model's dtype (an A/B).
    lora_upcast: Switch = Field(default="auto", validation_alias="CORRAL_LORA_UPCAST")
    # CORRAL_MATMUL_PROMPT_ATTENTION: prompt chunks attend through batched matmuls in blocks of query
    # rows instead of PyTorch's SDPA; auto: bf16 on CPUs with native bf16 (2.3-2.9x the attention
    # there, AVX512-BF16), 1: on any CPU, 0: never (model/attention.py:prompt_block_rows).
    matmul_prompt_attention: Switch = Field(default="auto", validation_alias="CORRAL_MATMUL_PROMPT_ATTENTION")
    # CORRAL_INT4_KERNEL: int4 checkpoints' (AWQ, GPTQ, W4A16) layers through PyTorch's int4 kernel;
    # auto: bfloat16 models (CPU; CUDA where tinygemm runs), others dequantized at load (the CPU
    # kernel with float32 activations is slower than a dense float32 matmul); 1: float32 models on
    # the CPU too (a quarter of the weight memory); 0: always dequantized (the A/B).
    int4_kernel: Switch = Field(default="auto", validation_alias="CORRAL_INT4_KERNEL")
    # CORRAL_OVERLAP_OUTPUT: a step's text work (detokenization, stop strings, the outputs) runs
    # in the next step while the device computes, so outputs come one step later; auto: on CUDA.
    overlap_output: Switch = Field(default="auto", validation_alias="CORRAL_OVERLAP_OUTPUT")
    # CORRAL_ASYNC_SCHEDULING: the next step is scheduled and launched before this step's tokens
    # reach the host (its inputs take them on the device), so the device never waits for the
    # host between decode steps; auto: on CUDA (H200, 8B: batch-64 steps 6.93 -> 5.69 ms, time
    # outside kernels 20.9 -> 3.4 %; docs/engine-speed.md). CPU steps run inside the host: no gain.
    async_scheduling: Switch = Field(default="auto", validation_alias="CORRAL_ASYNC_SCHEDULING")
    # CORRAL_ENGINE_PROCESS: the scheduler and model (the engine core) in a process of their own,
    # the server's process doing HTTP, tokenizing and streaming (vLLM v1's layout); auto: on CUDA,
    # where a step is short and the server's per-token work would share the GIL with it. On CPU a
    # model that keeps the cores busy runs as fast in one process (docs/engine-speed.md).
    engine_process: Switch = Field(default="auto", validation_alias="CORRAL_ENGINE_PROCESS")
    # CORRAL_TRITON_OPS: the model's elementwise work (residual add + RMSNorm, rotary, SiLU-and-
    # multiply) as fused Triton kernels; auto: on CUDA; 1 also on CPU (interpreted, slow: tests).
    triton_ops: Switch = Field(default="auto", validation_alias="CORRAL_TRITON_OPS")
    # TRITON_INTERPRET=1: Triton's interpreter runs Triton kernels on CPU tensors (slowly), so the
    # triton attention backend can run, and be tested, without a GPU.
    triton_interpret: bool = Field(default=False, validation_alias="TRITON_INTERPRET")
    # Where compiled kernels are cached (default ~/.cache/corral/kernels) and which compiler builds
    # them (default: cc, else gcc).
    kernel_cache_dir: Path | None = Field(default=None, validation_alias="CORRAL_KERNEL_CACHE")
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=true: vLLM's switch for POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter (with --enable-lora; `corral engine --allow-runtime-lora-updating` too).
    allow_runtime_lora_updating: bool = Field(
        default=False, validation_alias="VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    )
    compiler: str | None = Field(default=None, validation_alias="CC")

    def describe(self) -> str:
        """One log line: every switch and its value."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in type(self).model_fields)


ENV_NAMES = {name: str(field.validation_alias) for name, field in EngineSettings.model_fields.items()}


class SourceSettings(BaseSettings):
    """Where models come from: the cache, the PVC mount convention, and the credentials of each
    source, under the names the official clients use. Secrets stay `SecretStr` (masked in repr and
    logs) until the one call that hands them to a client."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    # CORRAL_MODEL_CACHE: the model cache (default ~/.cache/corral/models); a shared PVC on a cluster.
    model_cache_dir: Path | None = Field(default=None, validation_alias="CORRAL_MODEL_CACHE")
    # CORRAL_PVC_ROOT: pvc://CLAIM/PATH is read from <root>/CLAIM/PATH, where the claim is mounted.
    pvc_root: Path = Field(default=Path("/mnt/pvc"), validation_alias="CORRAL_PVC_ROOT")
    # The Hugging Face Hub: its token and, for a mirror or a stand-in, its address.
    hf_token: SecretStr | None = Field(default=None, validation_alias="HF_TOKEN")
    hf_endpoint: str | None = Field(default=None, validation_alias="HF_ENDPOINT")
    # S3 and S3-compatible stores (MinIO, Ceph, R2): boto3's standard variable names.
    aws_access_key_id: SecretStr | None = Field(default=None, validation_alias="AWS_ACCESS_KEY_ID")
    aws_secret_access_key: SecretStr | None = Field(default=None, validation_alias="AWS_SECRET_ACCESS_KEY")
    aws_session_token: SecretStr | None = Field(default=None, validation_alias="AWS_SESSION_TOKEN")
    aws_endpoint_url: str | None = Field(default=None, validation_alias="AWS_ENDPOINT_URL")
    aws_region: str | None = Field(
        default=None, validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION")
    )

    @property
    def cache_dir(self) -> Path:
        return self.model_cache_dir or Path.home() / ".cache" / "corral" / "models"
