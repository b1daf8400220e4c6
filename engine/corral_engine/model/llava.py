"""LLaVA (LlavaForConditionalGeneration): the CLIP vision tower and a two-layer projector beside the
text decoder. Images become rows of input embeddings at their placeholder positions; those
positions are ordinary causal tokens of the text model (same positions, same KV cache)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from corral_engine.model.config import ModelConfig
from corral_engine.model.llama import CausalLM, Linear
from corral_engine.model.vision import VisionTower, activation
from corral_engine.multimodal import ImageInput
from corral_engine.vision_config import LlavaVisionConfig


class MultiModalProjector(nn.Module):
    def __init__(self, vision: LlavaVisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.act = vision.projector_act
        in_features = vision.hidden_size * len(vision.feature_layers)
        self.linear_1 = Linear(in_features, text_hidden, bias=vision.projector_bias)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=vision.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, D_vision * layers] -> [rows, hidden]
        return self.linear_2(activation(self.act, self.linear_1(x)))


class LlavaLM(CausalLM):
    """The text model (CausalLM, unchanged) plus `embed_images`; the runner merges the images' rows
    into a step's input embeddings (model/image_cache.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if not isinstance(config.vision, LlavaVisionConfig):
            raise ValueError("LlavaLM needs a LLaVA vision config")
        self.vision_tower = VisionTower(config.vision)
        self.multi_modal_projector = MultiModalProjector(config.vision, config.hidden_size)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, num_image_tokens, hidden] in the model dtype."""
        features = self.vision_tower(pixel_values)  # [N, T, D * layers]
        num_images, num_tokens, dim = features.shape
        rows = self.multi_modal_projector(features.reshape(-1, dim))
        return rows.view(num_images, num_tokens, -1)

    def embed_inputs(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Each image's rows [num_image_tokens, hidden]: one tower run for all of them."""
        pixels = torch.from_numpy(np.stack([m.pixel_values for m in images])).to(device, dtype)
        return list(self.embed_images(pixels))
