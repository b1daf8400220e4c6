"""Token masks for a step's constrained sequences: filled by llguidance off the step thread while
the model runs, then applied to the logits before sampling.

A mask is a bitmask: int32 words, bit j of word i allows token 32*i + j. The fill starts before the
forward pass (the grammar state after the last accepted token is all it needs) on one worker
thread; llguidance releases the GIL while it computes, so the fill overlaps the model's matmuls.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from corral_engine.core.sequence import Sequence

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)  # [32]


@dataclass(slots=True)
class TokenMasks:
    rows: list[int]  # which rows of the step's sampled logits are constrained
    bitmask: torch.Tensor  # [len(rows), W] int32, on the CPU


class PendingMasks:
    NONE: PendingMasks  # a step without constrained sequences

    def __init__(self, masks: TokenMasks | None, future: Future[None] | None) -> None:
        self._masks = masks
        self._future = future

    def wait(self) -> TokenMasks | None:
        if self._future is not None:
            self._future.result()
        return self._masks


PendingMasks.NONE = PendingMasks(None, None)


class MaskBuilder:
    def __init__(self, mask_width: int) -> None:
        import llguidance

        self.mask_width = mask_width
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-grammar")

    def start(self, seqs: list[Sequence]) -> PendingMasks:
        """Begin filling masks for the constrained sequences among `seqs` (the rows that sample,
        in order)."""
        jobs: list[tuple[Any, int]] = []
        rows: list[int] = []
        for row, seq in enumerate(seqs):
            if seq.grammar is not None:
                jobs.append((seq.grammar, len(rows)))
                rows.append(row)
        if not rows:
            return PendingMasks.NONE
        bitmask = torch.empty((len(rows), self.mask_width), dtype=torch.int32)  # [k, W]
        future = self._pool.submit(self._fill, jobs, bitmask)
        return PendingMasks(TokenMasks(rows, bitmask), future)

    def _fill(self, jobs: list[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        self._executor.unsafe_compute_mask_ptr(
            jobs, bitmask.data_ptr(), self.mask_width * 4, bitmask.shape[0]
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def advance(seq: Sequence, token_id: int) -> None:
    """Feed a sampled token to the sequence's grammar. Masked sampling only picks allowed tokens,
    so a refusal means a bug or an unmasked path; the matcher then allows only EOS."""
    if not seq.grammar.consume_token(token_id):
        logger.warning(
            "request %s: the grammar refused token %d: %s",
            seq.request.request_id,
            token_id,
            seq.grammar.get_error(),
        )


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Set disallowed tokens' logits to -inf, in place. logits: [S, V] float32 (owned by the caller)."""
    k, width = masks.bitmask.shape
    allowed = ((masks.bitmask.unsqueeze(-1) >> _BITS) & 1).bool().view(k, width * 32)  # [k, W*32]
    vocab = logits.shape[1]
    if width * 32 < vocab:  # logits wider than the grammar's vocabulary: the rest is never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - width * 32), value=False)
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)  # [k, V]
    rows = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
    logits[rows] = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
