"""Token masks for a step's constrained sequences: filled by llguidance off the step thread while
the model runs, then applied to the logits before sampling.

A mask is a bitmask: int32 words, bit j of word i allows token 32*i + j. The fill starts before the
forward pass (the grammar state after the last accepted token is all it needs) on one worker
thread; llguidance releases the GIL while it computes, so the fill overlaps the model's matmuls.
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.core.sequence import Sequence
from corral_engine.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

if sys.byteorder != "little":  # the bit unpacking below reads int32 words as little-endian bytes
    raise ImportError("token masks assume a little-endian host")


@dataclass(slots=True)
class TokenMasks:
    rows: list[int]  # which rows of the step's sampled logits are constrained
    bitmask: torch.Tensor  # [len(rows), W] int32, on the CPU


@dataclass(slots=True)
class MaskStats:
    """Where constrained decoding's time goes (bench/engine/structured_cost.py reads it)."""

    num_fills: int = 0
    num_masks: int = 0
    fill_s: float = 0.0  # on the worker thread, overlapping the forward pass
    wait_s: float = 0.0  # the step thread blocked on an unfinished fill: the stall


class PendingMasks:
    NONE: PendingMasks  # a step without constrained sequences

    def __init__(
        self, masks: TokenMasks | None, future: Future[None] | None, stats: MaskStats | None = None
    ) -> None:
        self._masks = masks
        self._future = future
        self._stats = stats

    def wait(self) -> TokenMasks | None:
        if self._future is not None:
            start = time.perf_counter()
            self._future.result()
            if self._stats is not None:
                self._stats.wait_s += time.perf_counter() - start
        return self._masks


PendingMasks.NONE = PendingMasks(None, None)


class MaskBuilder:
    def __init__(self, mask_width: int) -> None:
        import llguidance

        self.mask_width = mask_width
        self.stats = MaskStats()
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
        return PendingMasks(TokenMasks(rows, bitmask), future, self.stats)

    def _fill(self, jobs: list[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        start = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(
            jobs, bitmask.data_ptr(), self.mask_width * 4, bitmask.shape[0]
        )
        self.stats.fill_s += time.perf_counter() - start
        self.stats.num_fills += 1
        self.stats.num_masks += len(jobs)

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
    """Set disallowed tokens' logits to -inf, in place. logits: [S, V] float32 (owned by the caller).

    In place on views only: at batch 64 and a 128k vocabulary a gathered copy of the rows costs
    several times the masking itself."""
    width = masks.bitmask.shape[1]
    vocab = logits.shape[1]
    # numpy unpacks bits in C; a little-endian host stores word i's bit j as byte 4i + j//8's bit
    # j%8, which bitorder="little" puts at 32i + j. The words are inverted first (cheap: W per row),
    # so the unpacked bits are the disallowed tokens, ready for masked_fill_.
    refused = np.unpackbits((~masks.bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
    disallowed = torch.from_numpy(refused.view(np.bool_))[:, : min(vocab, width * 32)]  # [k, <=V]
    disallowed = disallowed.to(logits.device, non_blocking=True)
    covered = disallowed.shape[1]
    if masks.rows == list(range(logits.shape[0])):  # every row constrained: one op
        logits[:, :covered].masked_fill_(disallowed, float("-inf"))
        logits[:, covered:] = float("-inf")  # logits wider than the grammar's vocabulary
        return
    for j, row in enumerate(masks.rows):
        logits[row, :covered].masked_fill_(disallowed[j], float("-inf"))
        logits[row, covered:] = float("-inf")


class StepMasks:
    """Each step's token masks for its constrained sequences; the builder (and its worker thread)
    starts with the first constrained request."""

    def __init__(self, grammars: GrammarCompiler) -> None:
        self._grammars = grammars
        self._builder: MaskBuilder | None = None

    def start(self, scheduled: list[ScheduledSeq]) -> PendingMasks:
        """Start filling the masks of a step's constrained sequences. The rows are those of the
        sequences that sample without drafts (constrained ones never draft), in step order."""
        if not self._grammars.is_used:
            return PendingMasks.NONE  # no request was ever constrained
        if self._builder is None:
            self._builder = MaskBuilder(self._grammars.mask_width)
        return self._builder.start([s.seq for s in scheduled if s.samples and not s.num_spec])

    @property
    def stats(self) -> MaskStats:
        return self._builder.stats if self._builder is not None else MaskStats()
