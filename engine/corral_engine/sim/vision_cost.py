"""What embedding images adds to a simulated step: a vision-language checkpoint's vision tower and
projector as a roofline on the profile's GPUs, run at the first step that prefills any of an image's
placeholders, as the engine's encoder cache (model/image_cache.py) runs it. LLaVA's CLIP tower
costs the same for every image; Qwen-VL's follows each image's own patch grid."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.qwen_vision_config import QwenVisionConfig
from corral_engine.sim.perf_model import H100, LLAMA3_8B, Gpu, ModelShape, Profile, Roofline
from corral_engine.vision_config import LlavaVisionConfig, VisionConfig

Grid = tuple[int, int, int] | None  # an image's patch grid (t, h, w); None: a fixed-size tower's


class Tower(Protocol):
    """A tower's weights, and the FLOPs one image of patch grid `grid` takes through it."""

    @property
    def num_params(self) -> int: ...

    def flops(self, grid: Grid) -> float: ...


@dataclass(frozen=True, slots=True)
class TowerShape:
    """One image's trip through a CLIP tower and the two-layer projector: the matmuls' weights and
    sizes (biases, norms and position embeddings are rounding errors, left out)."""

    num_patches: int
    num_layers: int  # encoder layers run: up to the deepest feature layer, as the engine's tower
    hidden_size: int
    intermediate_size: int
    patch_params: int  # the patch embedding: channels x patch_size^2 x hidden
    projector_in_size: int  # hidden x the number of feature layers concatenated
    num_image_tokens: int  # the rows the projector maps (placeholder tokens an image)
    text_hidden_size: int  # the projector's output: the text model's hidden size

    @classmethod
    def of(cls, vision: LlavaVisionConfig, text_hidden_size: int) -> TowerShape:
        return cls(
            num_patches=vision.num_patches,
            num_layers=max(vision.layer_indices),
            hidden_size=vision.hidden_size,
            intermediate_size=vision.intermediate_size,
            patch_params=vision.num_channels * vision.patch_size**2 * vision.hidden_size,
            projector_in_size=vision.hidden_size * len(vision.feature_layers),
            num_image_tokens=vision.num_image_tokens,
            text_hidden_size=text_hidden_size,
        )

    @property
    def layer_params(self) -> int:
        """q, k, v, o (hidden^2 each) and the MLP's two (hidden x intermediate each)."""
        return 4 * self.hidden_size**2 + 2 * self.hidden_size * self.intermediate_size

    @property
    def projector_params(self) -> int:
        return self.projector_in_size * self.text_hidden_size + self.text_hidden_size**2

    @property
    def num_params(self) -> int:
        return self.patch_params + self.num_layers * self.layer_params + self.projector_params

    def flops(self, grid: Grid) -> float:
        """Every image is resized to the tower's input: the same FLOPs whatever `grid`."""
        return self.flops_per_image

    @property
    def flops_per_image(self) -> float:
        """2 FLOPs a weight a row, and attention's 4 x positions^2 x hidden a layer (not causal)."""
        num_positions = self.num_patches + 1  # the class position
        layer = 2 * num_positions * self.layer_params + 4 * num_positions**2 * self.hidden_size
        return (
            2 * self.num_patches * self.patch_params
            + self.num_layers * layer
            + 2 * self.num_image_tokens * self.projector_params
        )


@dataclass(frozen=True, slots=True)
class QwenTowerShape:
    """Qwen2-VL's and Qwen2.5-VL's tower: each image's patches (t x h x w of its grid) through the
    layers, then the merger mapping each 2x2 group into one text-model row. Qwen2.5-VL's layers
    outside `num_full_layers` attend within windows of `window_patches`; its MLP is gated (three
    matrices, not two)."""

    embed_dim: int
    intermediate_size: int
    patch_size: int  # pixels a patch side
    num_layers: int
    num_full_layers: int  # layers attending over the whole image (all of Qwen2-VL's)
    window_patches: int  # patches a windowed layer attends within
    num_mlp_matrices: int  # 2 (Qwen2-VL) or 3 (Qwen2.5-VL, gated)
    patch_params: int  # the Conv3d patch embedding: channels x temporal x patch^2 x embed_dim
    merge_rows: int  # patches one merged row reads (spatial_merge_size^2)
    text_hidden_size: int  # the merger's output

    @classmethod
    def of(cls, vision: QwenVisionConfig) -> QwenTowerShape:
        is_windowed = vision.is_qwen2_5
        return cls(
            embed_dim=vision.embed_dim,
            intermediate_size=vision.intermediate_size,
            patch_size=vision.patch_size,
            num_layers=vision.depth,
            num_full_layers=len(vision.fullatt_block_indexes) if is_windowed else vision.depth,
            window_patches=(vision.window_size // vision.patch_size) ** 2 if is_windowed else 0,
            num_mlp_matrices=3 if is_windowed else 2,
            patch_params=vision.patch_dim * vision.embed_dim,
            merge_rows=vision.spatial_merge_size**2,
            text_hidden_size=vision.out_hidden_size,
        )

    @property
    def layer_params(self) -> int:
        d = self.embed_dim
        return 4 * d * d + self.num_mlp_matrices * d * self.intermediate_size

    @property
    def merger_params(self) -> int:
        width = self.embed_dim * self.merge_rows
        return width * width + width * self.text_hidden_size

    @property
    def num_params(self) -> int:
        return self.patch_params + self.num_layers * self.layer_params + self.merger_params

    def flops(self, grid: Grid) -> float:
        """2 FLOPs a weight a patch; attention 4 x patches x span x embed_dim a layer, the span
        the whole image or (windowed layers) a window; the merger on patches / merge_rows rows."""
        num_patches = math.prod(grid) if grid is not None else 0
        d = self.embed_dim
        full = 2 * num_patches * self.layer_params + 4 * num_patches**2 * d
        span = min(self.window_patches, num_patches)
        windowed = 2 * num_patches * self.layer_params + 4 * num_patches * span * d
        num_windowed = self.num_layers - self.num_full_layers
        return (
            2 * num_patches * self.patch_params
            + self.num_full_layers * full
            + num_windowed * windowed
            + 2 * (num_patches // self.merge_rows) * self.merger_params
        )


def tower_shape(vision: VisionConfig, text_hidden_size: int) -> Tower:
    """The tower of a checkpoint's vision_config (LLaVA's projecting into `text_hidden_size`;
    Qwen-VL's merger states its own)."""
    if isinstance(vision, QwenVisionConfig):
        return QwenTowerShape.of(vision)
    return TowerShape.of(vision, text_hidden_size)


@dataclass(frozen=True, slots=True)
class VisionCost:
    """Seconds the tower adds to a step that embeds images, on each GPU of the profile (the
    tower's matmuls sharded over them as the text model's are)."""

    tower: Tower
    flops_s: float  # per GPU, at the roofline's compute efficiency
    memory_bandwidth_bytes_s: float  # per GPU, at the roofline's bandwidth efficiency
    num_gpus: int = 1
    bytes_per_param: int = 2  # the model dtype: quantization leaves the tower as it is

    def step_time_s(self, grids: Sequence[Grid]) -> float:
        """max(the images' FLOPs, the tower's weights read once) for images of these patch grids;
        nothing for no image."""
        if not grids:
            return 0.0
        compute_s = sum(self.tower.flops(g) for g in grids) / (self.num_gpus * self.flops_s)
        read_s = (
            self.tower.num_params * self.bytes_per_param / (self.num_gpus * self.memory_bandwidth_bytes_s)
        )
        return max(compute_s, read_s)


def vision_cost(
    profile: Profile, vision: VisionConfig, gpu: Gpu = H100, model: ModelShape = LLAMA3_8B
) -> VisionCost:
    """The tower of `vision` (the checkpoint's vision_config) on `profile`'s GPUs, projecting into
    its text model's hidden size; a fitted profile (no shapes) is taken as one `gpu` serving `model`."""
    roofline = profile.model if isinstance(profile.model, Roofline) else Roofline(gpu, model)
    return VisionCost(
        tower_shape(vision, roofline.model.hidden_size),
        flops_s=roofline.compute_efficiency * roofline.gpu.peak_flops,
        memory_bandwidth_bytes_s=roofline.bandwidth_efficiency * roofline.gpu.memory_bandwidth_bytes_s,
        num_gpus=roofline.num_gpus,
        bytes_per_param=roofline.model.bytes_per_param,
    )


class ImageSteps:
    """Which images each step embeds, as the engine's encoder cache decides: an image of a sequence
    runs through the tower at the first step whose chunk covers any of its placeholders, and again
    only once all of them were computed and a later chunk covers them anew (a recompute)."""

    def __init__(self, cost: VisionCost) -> None:
        self.cost = cost
        self._open: set[tuple[int, int]] = set()  # (seq id, image index): embedded, not all computed
        self.num_images_embedded = 0  # tower runs (one per image), as the engine's counter

    def step_time_s(self, scheduled: Iterable[ScheduledSeq]) -> float:
        """The tower's seconds for the images this step embeds (marks them embedded)."""
        grids: list[Grid] = []
        for s in scheduled:
            end = s.start + s.num_new_tokens
            for index, m in enumerate(s.seq.request.mm_inputs):
                if not (m.offset < end and s.start < m.end):
                    continue
                key = (s.seq.seq_id, index)
                if key not in self._open:
                    grids.append(m.grid_thw)
                    self._open.add(key)
                if end >= m.end:  # its last placeholder is computed now: no chunk reads it again
                    self._open.discard(key)
        self.num_images_embedded += len(grids)
        return self.cost.step_time_s(grids)

    def release(self, seq_id: int) -> None:
        """The sequence finished or was aborted."""
        self._open = {k for k in self._open if k[0] != seq_id}
