"""What the engine needs of a vision-language checkpoint's vision side (LLaVA-1.5: a CLIP vision
tower, a two-layer projector, image placeholder tokens in the text model; Qwen2-VL and Qwen2.5-VL:
qwen_vision_config.py), checked at load time. No torch: the server's side and the request builder
read it too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError
from corral_engine.qwen_vision_config import (
    QWEN_VL_ARCHITECTURES,
    QWEN_VL_MODEL_TYPES,
    QwenVisionConfig,
    load_qwen_vision_config,
)

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", *QWEN_VL_ARCHITECTURES)
# Multi-tile or other-tower vision models refused by name (not a generic "unsupported").
REFUSED_VISION_ARCHITECTURES = {
    "LlavaNextForConditionalGeneration": "LLaVA-NeXT's anyres image tiling",
    "LlavaNextVideoForConditionalGeneration": "LLaVA-NeXT's anyres image tiling and video",
    "LlavaOnevisionForConditionalGeneration": "LLaVA-OneVision's anyres image tiling",
    "Mistral3ForConditionalGeneration": "Mistral 3's Pixtral vision tower",
    "Llama4ForConditionalGeneration": "Llama 4's vision tower",
}
# The text models LLaVA checkpoints pair with, by text_config.model_type.
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
VISION_ACTIVATIONS = ("quick_gelu", "gelu")  # CLIP's and the projector's, as transformers names them
SELECT_STRATEGIES = ("default", "full")  # default: drop the CLS position


@dataclass(frozen=True, slots=True)
class LlavaVisionConfig:
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    # Which hidden states feed the projector (transformers' indices: 0 is the embeddings, i the
    # output of layer i; negatives count from the end), concatenated along features.
    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str
    projector_bias: bool
    image_token_id: int
    text_architecture: str  # the text model's class (LlamaForCausalLM, ...)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and embedding rows) per image."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """The feature layers as counts of encoder layers run (0: the embeddings alone)."""
        return tuple(i if i >= 0 else self.num_layers + 1 + i for i in self.feature_layers)


# Any vision-language model's vision side (ModelConfig.vision).
VisionConfig = LlavaVisionConfig | QwenVisionConfig


def load_vision_config(hf: Any, where: Path) -> VisionConfig:
    """A transformers LlavaConfig (or a Qwen-VL one), checked: anything the engine cannot compute
    is refused by name."""
    if getattr(hf, "model_type", None) in QWEN_VL_MODEL_TYPES:
        return load_qwen_vision_config(hf, where)
    vision = hf.vision_config
    if getattr(vision, "model_type", None) != "clip_vision_model":
        raise ModelLoadError(
            f"{where}: vision_config.model_type {getattr(vision, 'model_type', None)!r} is not supported "
            "(LLaVA with a CLIP vision tower only)"
        )
    text_type = getattr(hf.text_config, "model_type", None)
    if text_type not in TEXT_ARCHITECTURES:
        raise ModelLoadError(
            f"{where}: text_config.model_type {text_type!r} is not supported for LLaVA "
            f"({', '.join(TEXT_ARCHITECTURES)})"
        )
    for field, value in (
        ("vision_config.hidden_act", vision.hidden_act),
        ("projector_hidden_act", hf.projector_hidden_act),
    ):
        if value not in VISION_ACTIVATIONS:
            raise ModelLoadError(
                f"{where}: {field} {value!r} is not supported ({', '.join(VISION_ACTIVATIONS)})"
            )
    strategy = hf.vision_feature_select_strategy
    if strategy not in SELECT_STRATEGIES:
        raise ModelLoadError(f"{where}: vision_feature_select_strategy {strategy!r} is not supported")
    raw_layers = hf.vision_feature_layer
    layers = tuple(raw_layers) if isinstance(raw_layers, list | tuple) else (raw_layers,)
    num_layers = int(vision.num_hidden_layers)
    if not layers or any(not isinstance(i, int) or not -num_layers - 1 <= i <= num_layers for i in layers):
        raise ModelLoadError(f"{where}: vision_feature_layer {raw_layers!r} names no layer of {num_layers}")
    if vision.image_size % vision.patch_size:
        raise ModelLoadError(f"{where}: image_size {vision.image_size} is not a multiple of patch_size")
    return LlavaVisionConfig(
        image_size=int(vision.image_size),
        patch_size=int(vision.patch_size),
        num_channels=int(vision.num_channels),
        hidden_size=int(vision.hidden_size),
        intermediate_size=int(vision.intermediate_size),
        num_layers=num_layers,
        num_heads=int(vision.num_attention_heads),
        layer_norm_eps=float(vision.layer_norm_eps),
        hidden_act=str(vision.hidden_act),
        feature_layers=layers,
        select_strategy=str(strategy),
        projector_act=str(hf.projector_hidden_act),
        projector_bias=bool(getattr(hf, "multimodal_projector_bias", True)),
        image_token_id=int(hf.image_token_id),
        text_architecture=TEXT_ARCHITECTURES[text_type],
    )
