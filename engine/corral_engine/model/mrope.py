"""M-RoPE (Qwen2-VL, Qwen2.5-VL): the text model's rotary frequencies split into three sections
driven by a temporal, a height and a width position. Text tokens have one position on all three
streams (plain 1-D rope); an image's placeholders take its merged grid's (t, h, w) offsets from
where the image starts, and the text after it continues from the largest of them. A sequence's
tokens past its last image are therefore at `index + delta` (vLLM's mrope_position_delta), which
is all a decode step needs: decodes keep the plain 1-D path, shifted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.model.batch import upload
from corral_engine.model.config import ModelConfig
from corral_engine.model.rotary import Rotary
from corral_engine.multimodal import ImageInput


class MRotary(Rotary):
    """cos/sin for positions [T] (every stream equal: the plain table) or [3, T] (t, h, w)."""

    def __init__(self, config: ModelConfig, sections: tuple[int, int, int]) -> None:
        super().__init__(config)
        self.sections = list(sections)  # frequency pairs per stream; they sum to R / 2

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()  # [3, T, R/2]
        # Section i of the frequencies turns with stream i % 3's position.
        picked = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.sections, dim=-1))], dim=-1)
        emb = torch.cat((picked, picked), dim=-1)  # [T, R]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, R]


def mrope_positions(images: Sequence[ImageInput], merge_size: int, start: int, end: int) -> np.ndarray:
    """[3, end - start] int64: the (t, h, w) positions of a prompt's tokens [start, end) (images in
    prompt order; tokens past the last image continue at index + delta)."""
    out = np.empty((3, end - start), dtype=np.int64)
    index, position = 0, 0  # the next token's index and the position it takes if it is text
    for m in images:
        _text(out, start, end, index, m.offset, position)
        position += m.offset - index
        _, grid_h, grid_w = _llm_grid(m, merge_size)
        lo, hi = max(start, m.offset), min(end, m.end)
        if lo < hi:
            k = np.arange(lo - m.offset, hi - m.offset)  # the image's rows, t-major then h, w
            hw = grid_h * grid_w
            out[0, lo - start : hi - start] = position + k // hw
            out[1, lo - start : hi - start] = position + (k % hw) // grid_w
            out[2, lo - start : hi - start] = position + k % grid_w
        position += max(grid_h, grid_w)  # as transformers' get_rope_index: the image's extent
        index = m.end
    _text(out, start, end, index, max(end, index), position)
    return out


def position_delta(images: Sequence[ImageInput], merge_size: int) -> int:
    """Position minus index of every token past the last image (0 without images)."""
    delta = 0
    for m in images:
        _, grid_h, grid_w = _llm_grid(m, merge_size)
        delta += max(grid_h, grid_w) - m.length
    return delta


class MropePositions:
    """A step's positions for a Qwen-VL model: [3, T] when a chunk covers tokens up to an image's
    end, else the batch's own [T] positions, shifted per sequence by its delta."""

    def __init__(self, merge_size: int, device: torch.device) -> None:
        self.merge_size = merge_size
        self.device = device

    def positions(self, scheduled: list[ScheduledSeq], positions: torch.Tensor) -> torch.Tensor:
        """The step's positions: `positions` (the batch's [T]) itself when no sequence has images."""
        if not any(s.seq.request.mm_inputs for s in scheduled):
            return positions
        parts: list[np.ndarray] = []
        for s in scheduled:
            images, start, end = s.seq.request.mm_inputs, s.start, s.start + s.num_new_tokens
            if images and start < images[-1].end:
                parts.append(mrope_positions(images, self.merge_size, start, end))
            else:
                shift = position_delta(images, self.merge_size)
                parts.append(np.broadcast_to(np.arange(start + shift, end + shift), (3, end - start)))
        host = torch.from_numpy(np.concatenate(parts, axis=1))
        return upload(host, self.device)

    def shift_decodes(self, positions: list[int], scheduled: list[ScheduledSeq]) -> None:
        """A plain decode step's host positions (one a sequence, in order) shifted in place."""
        for i, s in enumerate(scheduled):
            images = s.seq.request.mm_inputs
            if images:
                positions[i] += position_delta(images, self.merge_size)


def _llm_grid(m: ImageInput, merge_size: int) -> tuple[int, int, int]:
    if m.grid_thw is None:
        raise ValueError("a Qwen-VL image needs its grid (image_grid_thw)")
    t, h, w = m.grid_thw
    return t, h // merge_size, w // merge_size


def _text(out: np.ndarray, start: int, end: int, first: int, stop: int, position: int) -> None:
    """Text tokens [first, stop) at `position` onwards on all three streams, where [start, end) holds them."""
    lo, hi = max(start, first), min(end, stop)
    if lo < hi:
        out[:, lo - start : hi - start] = np.arange(lo, hi) - first + position
