"""CUDA graphs for decode steps (the triton attention backend).

A decode step launches hundreds of small kernels whose launch cost, at small batches, exceeds
their run time. A CUDA graph records one forward pass per padded batch size once, at start-up,
and replays it with a single launch. A replay reads its inputs from persistent device buffers,
so a step writes its token ids, positions, KV slots, query starts, context lengths and block
tables into those buffers (two host-to-device copies from pinned memory) and replays the graph of
the smallest captured size that holds its sequences. Padding rows get slot -1 (the KV write skips
them) and padding sequences context length 0 (attention skips them); their output rows are junk
that nobody reads.

What records and replays is a `GraphCapture`: `CudaGraphCapture` on a GPU, `EagerCapture` where
there is none (tests), which runs the forward pass again at each "replay", reading the same
persistent buffers, so the buffer plumbing is exercised exactly as a replay would read it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch

from corral_engine.model.attention import AttentionContext, UnifiedBatch
from corral_engine.model.batch import UnifiedHostBatch

logger = logging.getLogger(__name__)

# (input_ids, positions, ctx) -> hidden states [T, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionContext], torch.Tensor]


class GraphCapture(Protocol):
    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record `run` (a forward pass over persistent buffers); return its replay, which
        returns the same output tensor, refilled."""
        ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, all sizes sharing one memory pool (captured largest first)."""

    def __init__(self) -> None:
        self._pool: Any = None  # the first graph's memory pool handle

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerCapture:
    """Stands in for CUDA graphs without a GPU: "capture" runs the pass once, "replay" runs it
    again over the same buffers. Records what was captured and replayed, for tests."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # token rows of each captured pass, in capture order
        self.replayed: list[int] = []

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        rows = run().shape[0]
        self.captured.append(rows)

        def replay() -> torch.Tensor:
            self.replayed.append(rows)
            return run()

        return replay


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to max_num_seqs
    (itself included), so a batch pads by at most 7 sequences (vLLM's ladder)."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Captured decode passes, one per size of `capture_sizes`, and their persistent buffers."""

    def __init__(
        self,
        forward: Forward,
        capture: GraphCapture,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self._n = n
        pinned = device.type == "cuda"
        # One int32 vector for the per-row and per-sequence inputs (one copy a step):
        # [input_ids n | positions n | slots n | query starts n + 1 | context lengths n | pending n]
        # (pending: which of the last step's sampled ids is the row's input, -1 none; not read by
        # the graphs, see `run`)
        self._host_meta = torch.zeros(6 * n + 1, dtype=torch.int32, pin_memory=pinned)
        self._host_tables = torch.zeros((n, max(1, max_blocks_per_seq)), dtype=torch.int32, pin_memory=pinned)
        self._meta = torch.zeros(6 * n + 1, dtype=torch.int32, device=device)
        self._tables = torch.zeros((n, max(1, max_blocks_per_seq)), dtype=torch.int32, device=device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        # Recorded after each step's copies out of the pinned buffers: the next step rewrites them
        # only once the device has read them (with async scheduling the host runs a step ahead).
        self._copied: torch.cuda.Event | None = None
        self._fill_padding(0)
        self._meta.copy_(self._host_meta)
        started = time.monotonic()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            ids, positions, slots, starts, lens = self._views(self._meta, size)
            unified = UnifiedBatch(starts, lens, self._tables[:size], max_query_len=1)
            ctx = AttentionContext(slots, [], block_size, unified=unified)
            self._replays[size] = capture.capture(partial(forward, ids, positions, ctx))
        logger.info(
            "captured decode graphs for %d batch sizes up to %d in %.1f s",
            len(self.sizes),
            n,
            time.monotonic() - started,
        )

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size holding `num_seqs` sequences, or None (too many)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def run(
        self,
        host: UnifiedHostBatch,
        block_tables: torch.Tensor,
        pending: tuple[torch.Tensor, list[int], list[int]] | None = None,
    ) -> torch.Tensor:
        """Hidden states [S, hidden] of a plain decode step of S <= max_num_seqs sequences;
        `block_tables`: [S, host.max_blocks] int32 on the host. `pending`: (the last step's
        sampled ids on the device, rows, indices): those rows' input ids are taken from those
        ids on the device, after the inputs' copy and before the replay, with no host wait."""
        num_seqs = len(host.seq_lens)
        size = self.padded_size(num_seqs)
        if size is None or not host.is_plain_decode:
            raise ValueError(f"not a capturable decode step: {num_seqs} sequences")
        if self._copied is not None:
            self._copied.synchronize()  # done long ago, unless the device is far behind
        ids, positions, slots, starts, lens = self._views(self._host_meta, self._n)
        ids[:num_seqs] = torch.tensor(host.input_ids, dtype=torch.int32)
        positions[:num_seqs] = torch.tensor(host.positions, dtype=torch.int32)
        slots[:num_seqs] = torch.tensor(host.slots, dtype=torch.int32)
        starts[: num_seqs + 1] = torch.tensor(host.query_starts, dtype=torch.int32)
        lens[:num_seqs] = torch.tensor(host.seq_lens, dtype=torch.int32)
        self._fill_padding(num_seqs)
        self._host_tables[:num_seqs, : host.max_blocks] = block_tables
        n = self._n
        host_src = self._host_meta[5 * n + 1 : 5 * n + 1 + size]
        if pending is not None:
            host_src.fill_(-1)
            tokens, rows, indices = pending
            host_src[rows] = torch.tensor(indices, dtype=torch.int32)
        self._meta.copy_(self._host_meta, non_blocking=True)
        self._tables[:size].copy_(self._host_tables[:size], non_blocking=True)
        if self._meta.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if pending is not None:
            src = self._meta[5 * n + 1 : 5 * n + 1 + size]
            ids = self._meta[:size]
            picked = tokens.index_select(0, src.clamp(min=0).long()).to(torch.int32)
            ids.copy_(torch.where(src >= 0, picked, ids))
        return self._replays[size]()[:num_seqs]

    def _fill_padding(self, num_seqs: int) -> None:
        """Rows and sequences from num_seqs on: token 0 at position 0, no KV slot, no queries,
        no context."""
        ids, positions, slots, starts, lens = self._views(self._host_meta, self._n)
        ids[num_seqs:] = 0
        positions[num_seqs:] = 0
        slots[num_seqs:] = -1
        starts[num_seqs + 1 :] = num_seqs
        lens[num_seqs:] = 0

    def _views(self, meta: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        n = self._n
        return (
            meta[:size],
            meta[n : n + size],
            meta[2 * n : 2 * n + size],
            meta[3 * n : 3 * n + size + 1],
            meta[4 * n + 1 : 4 * n + 1 + size],
        )
