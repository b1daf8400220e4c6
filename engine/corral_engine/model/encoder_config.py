"""What an encoder-only model (BERT, RoBERTa, XLM-RoBERTa; embeddings, a sequence-classification
head as rerankers have, or a token-classification head) needs from config.json, checked once at
load time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError
from corral_engine.model.hf_config import auto_config
from corral_engine.pooling import (
    ENCODER_ARCHITECTURES,
    is_classifier_architecture,
    is_encoder_architecture,
    is_token_classifier_architecture,
)

SUPPORTED_ENCODERS = tuple(ENCODER_ARCHITECTURES)
# transformers' ACT2FN names: erf GELU, and the tanh approximation under both of its names.
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# transformers' problem types of a sequence classifier (how its outputs are activated: pooling.py).
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int  # rows of the position table
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str  # one of ENCODER_ACTIVATIONS
    pad_token_id: int
    # Position id of a sequence's first token: 0 for BERT; padding_idx + 1 for RoBERTa and
    # XLM-RoBERTa (transformers' create_position_ids_from_input_ids on an unpadded sequence).
    position_offset: int
    torch_dtype: str | None
    # Outputs of the sequence-classification head (config.json's id2label); 0: no head (embeddings).
    num_labels: int = 0
    labels: tuple[str | None, ...] = ()  # each output's name (id2label), None where it has none
    problem_type: str | None = None  # transformers': regression, single- or multi-label classification
    is_token_classifier: bool = False  # the head labels each token (*ForTokenClassification)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_model_len(self) -> int:
        """The longest sequence the position table covers (514 - 2 = 512 for XLM-RoBERTa)."""
        return self.max_position_embeddings - self.position_offset


def load_encoder_config(model_dir: str | Path, raw: dict[str, Any] | None = None) -> EncoderConfig:
    """The encoder config of the checkpoint in `model_dir` (transformers fills the fields its
    config.json leaves at their defaults; `raw`: that file's JSON where the caller has read it);
    ModelLoadError naming what is wrong."""
    path = Path(model_dir)
    config_file = path / "config.json"
    if raw is None:
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {config_file}: {e}") from e
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    arch = (
        next((a for a in archs if isinstance(a, str) and is_encoder_architecture(a)), None)
        if isinstance(archs, list)
        else None
    )
    if arch is None:
        raise ModelLoadError(
            f"{config_file}: architecture {archs!r} is not an encoder; supported: "
            f"{', '.join(ENCODER_ARCHITECTURES)}"
        )
    hf = auto_config(path)
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return encoder_config_from_hf(hf, arch, path, dtype if isinstance(dtype, str) else None)


def encoder_config_from_hf(hf: Any, arch: str, path: Path, torch_dtype: str | None = None) -> EncoderConfig:
    """Check a transformers config of architecture `arch`: a value the Encoder cannot compute is
    refused by name."""
    where = path / "config.json"
    kind = getattr(hf, "position_embedding_type", None) or "absolute"
    if kind != "absolute":
        raise ModelLoadError(
            f"{where}: position_embedding_type {kind!r} is not supported (absolute position embeddings only)"
        )
    if getattr(hf, "is_decoder", False) or getattr(hf, "add_cross_attention", False):
        raise ModelLoadError(f"{where}: {arch} configured as a decoder (is_decoder) is not an encoder")
    act = getattr(hf, "hidden_act", None)
    if act not in ENCODER_ACTIVATIONS:
        raise ModelLoadError(
            f"{where}: hidden_act {act!r} is not supported; supported: {', '.join(ENCODER_ACTIVATIONS)}"
        )
    hidden, heads = _int(hf, "hidden_size", where), _int(hf, "num_attention_heads", where)
    if hidden % heads:
        raise ModelLoadError(
            f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    pad = getattr(hf, "pad_token_id", None)
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ModelLoadError(f"{where}: pad_token_id must be a non-negative integer, got {pad!r}")
    offset = pad + 1 if ENCODER_ARCHITECTURES[arch] else 0
    max_positions = _int(hf, "max_position_embeddings", where)
    if max_positions <= offset:
        raise ModelLoadError(
            f"{where}: max_position_embeddings {max_positions} leaves no positions past padding_idx {pad}"
        )
    eps = getattr(hf, "layer_norm_eps", None)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0:
        raise ModelLoadError(f"{where}: layer_norm_eps must be a positive number, got {eps!r}")
    return EncoderConfig(
        path=path,
        architecture=arch,
        vocab_size=_int(hf, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size", where),
        num_layers=_int(hf, "num_hidden_layers", where),
        num_heads=heads,
        max_position_embeddings=max_positions,
        type_vocab_size=_int(hf, "type_vocab_size", where),
        layer_norm_eps=float(eps),
        hidden_act=act,
        pad_token_id=pad,
        position_offset=offset,
        torch_dtype=torch_dtype,
        **_classifier_fields(hf, arch, where),
    )


def _classifier_fields(hf: Any, arch: str, where: Path) -> dict[str, Any]:
    """A classifier's num_labels, labels, problem_type and whether it labels each token (none of
    them for an embedding model)."""
    if not is_classifier_architecture(arch):
        return {}
    num_labels = _int(hf, "num_labels", where)
    id2label = getattr(hf, "id2label", None) or {}
    labels = tuple(str(id2label[i]) if i in id2label else None for i in range(num_labels))
    problem_type = getattr(hf, "problem_type", None)
    if problem_type is not None and problem_type not in PROBLEM_TYPES:
        raise ModelLoadError(
            f"{where}: problem_type {problem_type!r} is not one of {', '.join(PROBLEM_TYPES)}"
        )
    return {
        "num_labels": num_labels,
        "labels": labels,
        "problem_type": problem_type,
        "is_token_classifier": is_token_classifier_architecture(arch),
    }


def _int(hf: Any, name: str, where: Path) -> int:
    value = getattr(hf, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value
