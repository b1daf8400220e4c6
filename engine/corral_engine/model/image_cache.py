"""The encoder cache: each image's embeddings, computed once per sequence by the vision tower and
projector at the first step that prefills any of its placeholder positions, kept until all of them
are computed, and merged into each step's input embeddings at those positions (a prefill chunk
may hold part of an image's span; the scheduler need not know). A preempted sequence, or an
n > 1 sibling, computes them again when it recomputes those positions."""

from __future__ import annotations

import torch

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.model.llava import LlavaLM
from corral_engine.model.qwen_vl import QwenVLM
from corral_engine.multimodal import ImageInput

# (seq id, image index): the image's rows, [num_image_tokens, hidden] in the model dtype.
_Key = tuple[int, int]


class ImageEmbeddings:
    def __init__(self, model: LlavaLM | QwenVLM, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self._cache: dict[_Key, torch.Tensor] = {}
        self.num_images_embedded = 0  # vision tower runs (one per image): tests read it

    def has_images(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether a chunk of this step covers any placeholder position (else the plain path)."""
        for s in scheduled:
            for m in s.seq.request.mm_inputs:
                if m.offset < s.start + s.num_new_tokens and s.start < m.end:
                    return True
        return False

    def merge(self, scheduled: list[ScheduledSeq], input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings [T, hidden]: the token embeddings with every covered
        placeholder row replaced by its image's row."""
        self._embed_missing(scheduled)
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        row = 0
        for s in scheduled:
            start, end = s.start, s.start + s.num_new_tokens
            for index, m in enumerate(s.seq.request.mm_inputs):
                lo, hi = max(start, m.offset), min(end, m.end)
                if lo >= hi:
                    continue
                key = (s.seq.seq_id, index)
                parts.append(self._cache[key][lo - m.offset : hi - m.offset])
                rows.extend(range(row + lo - start, row + hi - start))
                if hi == m.end:  # its last placeholder is computed now: no chunk reads it again
                    del self._cache[key]
            row += s.num_new_tokens
        x = self.model.model.embed(input_ids)  # [T, hidden]
        targets = torch.tensor(rows, dtype=torch.long, device=x.device)
        return x.index_copy(0, targets, torch.cat(parts).to(x.dtype))

    def release(self, seq_id: int) -> None:
        """The sequence finished or was aborted: drop its images' rows."""
        for key in [k for k in self._cache if k[0] == seq_id]:
            del self._cache[key]

    def _embed_missing(self, scheduled: list[ScheduledSeq]) -> None:
        """Run the vision tower once over every image this step needs and has not embedded."""
        wanted: list[tuple[_Key, ImageInput]] = []
        for s in scheduled:
            end = s.start + s.num_new_tokens
            for index, m in enumerate(s.seq.request.mm_inputs):
                key = (s.seq.seq_id, index)
                if m.offset < end and s.start < m.end and key not in self._cache:
                    wanted.append((key, m))
        if not wanted:
            return
        embedded = self.model.embed_inputs([m for _, m in wanted], self.device, self.dtype)
        self.num_images_embedded += len(wanted)
        for (key, _), rows in zip(wanted, embedded, strict=True):
            self._cache[key] = rows
