"""What the engine needs from a checkpoint's config.json, checked once at load time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: Path
    architecture: str
    hf_config: Any  # transformers.PretrainedConfig; used for rope parameters
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]  # per layer
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _eos_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{gen}: cannot be read as JSON: {e}") from e
    for src in sources:
        for tok in src if isinstance(src, list) else [src]:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return tuple(ids)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir)
    if path.is_file():
        raise ModelLoadError(
            f"model path {str(path)!r} is a file, not a checkpoint directory "
            "(give the directory that holds config.json)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{config_file}: transformers cannot parse it: {e}") from e
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    num_layers = hf.num_hidden_layers
    layer_types = getattr(hf, "layer_types", None) or []
    window = getattr(hf, "sliding_window", None)
    windows: list[int | None] = []
    for i in range(num_layers):
        if layer_types:
            is_sliding = layer_types[i] == "sliding_attention"
        else:
            is_sliding = arch == "MistralForCausalLM"
        windows.append(window if is_sliding and window else None)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        path=path,
        architecture=arch,
        hf_config=hf,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=hf.max_position_embeddings,
        sliding_windows=tuple(windows),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "") or None,
        eos_token_ids=_eos_ids(path, hf),
    )
