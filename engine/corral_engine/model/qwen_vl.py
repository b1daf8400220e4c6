"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
the Qwen2 text decoder with M-RoPE (model/mrope.py) beside the vision tower and merger
(model/qwen_vision.py). Images become rows of input embeddings at their `<|image_pad|>` positions,
as LLaVA's do (model/image_cache.py)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from corral_engine.model.config import ModelConfig
from corral_engine.model.llama import CausalLM
from corral_engine.model.mrope import MRotary
from corral_engine.model.qwen_vision import QwenVisionTower
from corral_engine.multimodal import ImageInput
from corral_engine.qwen_vision_config import QwenVisionConfig


class QwenVLM(CausalLM):
    """The text model (CausalLM's layers; one M-RoPE table) plus `embed_inputs`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if not isinstance(config.vision, QwenVisionConfig):
            raise ValueError("QwenVLM needs a Qwen-VL vision config")
        self.vision_config = config.vision
        self.rotaries = nn.ModuleList([MRotary(config, config.vision.mrope_section)])
        self.visual = QwenVisionTower(config.vision)

    def embed_inputs(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Each image's rows [length, hidden] in the model dtype: one tower run for all of them."""
        grids = []
        for m in images:
            if m.grid_thw is None:
                raise ValueError("a Qwen-VL image needs its grid (image_grid_thw)")
            grids.append(m.grid_thw)
        pixels = torch.from_numpy(np.concatenate([m.pixel_values for m in images])).to(device, dtype)
        rows = self.visual(pixels, grids)  # [sum of lengths, hidden]
        return list(rows.split([m.length for m in images]))
