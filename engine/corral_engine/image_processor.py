"""The checkpoint's image processor (transformers AutoImageProcessor from the model directory, its
PIL backend: no torchvision) and a vision model's placeholder rules: a prompt's images built
(LLaVA: a fixed count of placeholders an image; Qwen-VL: each image's merged patch count)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from corral_engine.errors import InvalidRequestError
from corral_engine.multimodal import ImageInput, check_num_images, content_hash, expand_placeholders
from corral_engine.qwen_vision_config import QwenVisionConfig
from corral_engine.vision_config import VisionConfig


class ImageProcessor:
    """The checkpoint's image processor (transformers AutoImageProcessor, its PIL backend: no
    torchvision) and the placeholder rules of `vision`."""

    def __init__(
        self,
        model_dir: str | Path,
        vision: VisionConfig,
        max_images: int,
        allowed_hosts: tuple[str, ...] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.max_images = max_images
        self.allowed_hosts = allowed_hosts  # --allowed-media-domains: the server's URL fetches
        self.vision = vision
        self.image_token_id = vision.image_token_id
        self._processor: Any = None
        self._lock = threading.Lock()  # built once, on the first request with images

    def pixel_values(self, images: list[Any]) -> list[np.ndarray]:
        """[C, H, W] float32 per image, at the tower's image size (LLaVA)."""
        if isinstance(self.vision, QwenVisionConfig):
            raise TypeError("Qwen-VL images are built by qwen_images")
        processor = self._load()
        values = processor(images=images, return_tensors="np")["pixel_values"]
        size = self.vision.image_size
        if values.shape[-2:] != (size, size):  # a processor config that does not fit the tower
            raise InvalidRequestError(
                f"the image processor made {values.shape[-2:]} images; the vision tower takes {size}x{size}",
                "multi_modal_data",
            )
        return [np.asarray(v, dtype=np.float32) for v in values]

    def build(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image's placeholders expanded, and its images."""
        check_num_images(len(images), self.max_images)
        if isinstance(self.vision, QwenVisionConfig):
            return self._build_qwen(token_ids, images, self.vision)
        token_ids, spans = expand_placeholders(
            token_ids, len(images), self.vision.image_token_id, self.vision.num_image_tokens
        )
        if not images:
            return token_ids, ()
        pixels = self.pixel_values(images)
        return token_ids, tuple(
            ImageInput(p, offset, length, content_hash(p))
            for p, (offset, length) in zip(pixels, spans, strict=True)
        )

    def _build_qwen(
        self, token_ids: list[int], images: list[Any], vision: QwenVisionConfig
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Qwen-VL: each image at its own size (the processor's smart resize), so its placeholder
        count is its merged patch count; its patches [t*h*w, C*T*P*P] carry their grid."""
        pixels: list[np.ndarray] = []
        grids: list[tuple[int, int, int]] = []
        if images:
            out = self._load()(images=images, return_tensors="np")
            values = np.asarray(out["pixel_values"], dtype=np.float32)
            start = 0
            for t, h, w in np.asarray(out["image_grid_thw"]).tolist():
                pixels.append(values[start : start + t * h * w])
                grids.append((int(t), int(h), int(w)))
                start += t * h * w
            if values.shape[-1] != vision.patch_dim or start != len(values):
                raise InvalidRequestError(
                    f"the image processor made patches of {values.shape[-1]} values; the vision tower "
                    f"takes {vision.patch_dim}",
                    "multi_modal_data",
                )
        merge = vision.spatial_merge_size**2
        counts = [t * h * w // merge for t, h, w in grids]
        token_ids, spans = expand_placeholders(token_ids, len(images), vision.image_token_id, counts)
        return token_ids, tuple(
            # The hash reads the shape too: equal values on another grid are another image.
            ImageInput(p, offset, length, content_hash(p.reshape(*grid, -1)), grid)
            for p, grid, (offset, length) in zip(pixels, grids, spans, strict=True)
        )

    def _load(self) -> Any:
        with self._lock:
            if self._processor is None:
                from transformers import AutoImageProcessor

                try:
                    self._processor = AutoImageProcessor.from_pretrained(
                        self.model_dir, local_files_only=True, backend="pil"
                    )
                except TypeError:  # a transformers without backends
                    self._processor = AutoImageProcessor.from_pretrained(
                        self.model_dir, local_files_only=True
                    )
            return self._processor
