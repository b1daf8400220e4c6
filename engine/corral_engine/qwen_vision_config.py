"""What the engine needs of a Qwen2-VL or Qwen2.5-VL checkpoint's vision side (the vision
transformer, its 2x2 patch merger, the image tokens and the text model's M-RoPE sections), checked
at load time. No torch: the server's side and the request builder read it too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN_VL_ARCHITECTURES = (QWEN2_VL, QWEN2_5_VL)
QWEN_VL_MODEL_TYPES = {"qwen2_vl": QWEN2_VL, "qwen2_5_vl": QWEN2_5_VL}
# The towers' activations as transformers names them: Qwen2-VL's MLP, Qwen2.5-VL's gated one.
_ACTIVATIONS = {QWEN2_VL: ("quick_gelu", "gelu"), QWEN2_5_VL: ("silu",)}


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    architecture: str  # QWEN2_VL or QWEN2_5_VL
    embed_dim: int  # the tower's width
    out_hidden_size: int  # the merger's output: the text model's hidden size
    depth: int
    num_heads: int
    intermediate_size: int  # the tower's MLP
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    rope_theta: float  # the tower's 2-D rotary
    # Qwen2.5-VL: windowed attention in windows of window_size pixels a side, except these layers.
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    image_token_id: int  # <|image_pad|>
    video_token_id: int
    mrope_section: tuple[int, int, int]  # rotary frequency pairs driven by t, h and w positions
    text_architecture: str = "Qwen2ForCausalLM"

    @property
    def is_qwen2_5(self) -> bool:
        return self.architecture == QWEN2_5_VL

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch, as the image processor lays them out (C, T, P, P)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def load_qwen_vision_config(hf: Any, where: Path) -> QwenVisionConfig:
    """A transformers Qwen2VLConfig or Qwen2_5_VLConfig, checked; refusals name the field."""
    arch = QWEN_VL_MODEL_TYPES[hf.model_type]
    vision, text = hf.vision_config, hf.text_config
    is_2_5 = arch == QWEN2_5_VL
    act = str(vision.hidden_act)
    if act not in _ACTIVATIONS[arch]:
        raise ModelLoadError(
            f"{where}: vision_config.hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS[arch])})"
        )
    rope = getattr(text, "rope_parameters", None) or {}
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelLoadError(
            f"{where}: rope mrope_section {list(section)} must be three counts summing to head_dim / 2 "
            f"({head_dim // 2})"
        )
    embed_dim = int(vision.hidden_size if is_2_5 else vision.embed_dim)
    heads = int(vision.num_heads)
    if embed_dim % heads or (embed_dim // heads) % 4:
        raise ModelLoadError(f"{where}: the vision tower's head size must be a multiple of 4")
    vision_rope = getattr(vision, "rope_parameters", None) or {}
    return QwenVisionConfig(
        architecture=arch,
        embed_dim=embed_dim,
        out_hidden_size=int(vision.out_hidden_size if is_2_5 else vision.hidden_size),
        depth=int(vision.depth),
        num_heads=heads,
        intermediate_size=int(vision.intermediate_size if is_2_5 else embed_dim * vision.mlp_ratio),
        hidden_act=act,
        patch_size=int(vision.patch_size),
        temporal_patch_size=int(vision.temporal_patch_size),
        spatial_merge_size=int(vision.spatial_merge_size),
        in_channels=int(vision.in_channels),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
        window_size=int(vision.window_size) if is_2_5 else 0,
        fullatt_block_indexes=tuple(int(i) for i in vision.fullatt_block_indexes) if is_2_5 else (),
        image_token_id=int(hf.image_token_id),
        video_token_id=int(hf.video_token_id),
        mrope_section=(section[0], section[1], section[2]),
    )
