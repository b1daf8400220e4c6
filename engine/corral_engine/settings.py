"""Engine settings from the environment: the `CORRAL_*` switches that choose kernels and weight
layouts (fallbacks and A/B knobs, not engine arguments), read in this one place and passed down.

Light (no torch). `EngineSettings()` reads the environment once; `LLMEngine` builds it when not
given one, and `corral engine` builds it at start-up and logs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# "auto": the engine decides from the CPU it runs on; "1" forces the behaviour on; "0" off.
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
    # TRITON_INTERPRET=1: Triton's interpreter runs Triton kernels on CPU tensors (slowly), so the
    # triton attention backend can run, and be tested, without a GPU.
    triton_interpret: bool = Field(default=False, validation_alias="TRITON_INTERPRET")
    # Where compiled kernels are cached (default ~/.cache/corral/kernels) and which compiler builds
    # them (default: cc, else gcc).
    kernel_cache_dir: Path | None = Field(default=None, validation_alias="CORRAL_KERNEL_CACHE")
    compiler: str | None = Field(default=None, validation_alias="CC")

    def describe(self) -> str:
        """One log line: every switch and its value."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in type(self).model_fields)


ENV_NAMES = {name: str(field.validation_alias) for name, field in EngineSettings.model_fields.items()}
