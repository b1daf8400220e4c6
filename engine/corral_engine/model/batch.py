"""A step's model inputs: flattened token ids, positions, KV slots and the attention context,
built from the scheduled sequences; decode block tables are kept as rows across steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.model.attention import (
    AttentionContext,
    CausalSoftmax,
    DecodeBatch,
    KVWrite,
    SeqAttention,
    UnifiedBatch,
)
from corral_engine.model.native import PagedDecode


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, without a wait: a copy from
    pageable memory first waits for every kernel already queued (PyTorch synchronizes the stream),
    which holds the host back behind the step in flight instead of preparing the next one (async
    scheduling), and costs a round trip per tensor otherwise. torch's pinned-memory cache takes
    the block back only once the copy has run."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: AttentionContext
    logits_indices: torch.Tensor  # [S] rows of the batch whose next token is sampled


PENDING_TOKEN = -1  # a sequence's newest token while it is still on the device (async scheduling)


@dataclass(frozen=True, slots=True)
class TokenFill:
    """Input tokens not on the host yet: the last step's sampled ids (`tokens`, [S] on the
    device) and which of them is each waiting sequence's newest token (`rows`: seq id -> index).
    Those sequences hold PENDING_TOKEN in its place; the step's inputs take the id on the device."""

    tokens: torch.Tensor
    rows: dict[int, int]

    def targets(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], list[int]]:
        """(input rows, indices into `tokens`) of the chunks that end with a pending token (rows
        count the step's tokens in `scheduled` order, as every batch lays them out)."""
        dst: list[int] = []
        src: list[int] = []
        row = 0
        for s in scheduled:
            row += s.num_new_tokens
            index = self.rows.get(s.seq.seq_id)
            if index is not None and s.start + s.num_new_tokens == len(s.seq.token_ids):
                dst.append(row - 1 - s.num_spec)
                src.append(index)
        return dst, src

    def apply(self, input_ids: torch.Tensor, scheduled: list[ScheduledSeq]) -> None:
        """Write the pending ids into an eager step's input ids (on the device, in stream order)."""
        dst, src = self.targets(scheduled)
        if dst:
            device = input_ids.device
            picked = self.tokens.index_select(0, upload(torch.tensor(src, dtype=torch.long), device))
            rows = upload(torch.tensor(dst, dtype=torch.long), device)
            input_ids.index_copy_(0, rows, picked.to(input_ids.dtype))


@dataclass(slots=True)
class UnifiedHostBatch:
    """A step for the triton backend as host lists, before it becomes tensors: either the eager
    step's (StepBatch) or a captured decode graph's persistent buffers (model/cuda_graphs.py)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_indices: list[int]
    query_starts: list[int]  # [S + 1]
    seq_lens: list[int]  # [S]
    table_rows: list[int]  # [S]: each sequence's row of BlockTableRows.table
    max_query_len: int
    max_blocks: int  # the widest block table among the sequences
    num_prompt_rows: int = 0  # prompt_logprobs rows after the sampling rows of logits_indices

    @property
    def is_plain_decode(self) -> bool:
        """One new token per sequence, each sampled: the shape CUDA graphs capture."""
        return (
            self.max_query_len == 1
            and len(self.logits_indices) == len(self.seq_lens)
            and not self.num_prompt_rows
        )


class BatchBuilder:
    """Turns a step's scheduled sequences into a StepBatch on `device`.

    `unified` (the triton backend): every sequence in one UnifiedBatch. Otherwise prompt chunks go
    one by one and decodes are batched: `batched_decode` False attends them one sequence at a time
    (CORRAL_BATCHED_DECODE=0, for comparison); with a native `decode_kernel` all decodes go in one
    call at their own lengths, else in padded groups of similar length. `prompt_block_rows` > 0:
    prompt chunks attend through attention.matmul_prompt_attention in blocks of that many rows, with
    `prompt_softmax` (the native masked softmax) where given. `kv_write`: the native KV cache
    write where given (else index_copy_)."""

    def __init__(
        self,
        block_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        batched_decode: bool,
        decode_kernel: PagedDecode | None,
        unified: bool = False,
        prompt_block_rows: int = 0,
        prompt_softmax: CausalSoftmax | None = None,
        kv_write: KVWrite | None = None,
    ) -> None:
        self.block_size = block_size
        self.prompt_block_rows = prompt_block_rows
        self.prompt_softmax = prompt_softmax
        self.kv_write = kv_write
        self.device = device
        self.batched_decode = batched_decode
        self.decode_kernel = decode_kernel
        self.unified = unified
        self.block_rows = BlockTableRows(max_blocks_per_seq)

    def release(self, seq_id: int) -> None:
        """The sequence finished: its block-table row is free again."""
        self.block_rows.release(seq_id)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        if self.unified:
            return self.to_step_batch(self.prepare_unified(scheduled))
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[SeqAttention] = []
        logits_indices: list[int] = []
        decode_rows: list[int] = []
        decode_table_rows: list[int] = []  # each decode row's sequence in self.block_rows
        decode_num_blocks: list[int] = []
        decode_lens: list[int] = []
        prompt_rows: list[int] = []  # prompt_logprobs: after every sampling row
        row = 0
        for s in scheduled:
            seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
            _append_tokens(s, bs, input_ids, positions, slots)
            if self.batched_decode and (s.num_new_tokens == 1 or s.num_spec):
                # A decode, or a decode with draft tokens to verify: each of those rows attends
                # like a decode over the context up to itself (its K/V is written first).
                table_row = self.block_rows.row(seq.seq_id, seq.block_table)
                for j in range(s.num_new_tokens):
                    decode_rows.append(row + j)
                    decode_table_rows.append(table_row)
                    decode_num_blocks.append(-(-(start + j + 1) // bs))
                    decode_lens.append(start + j + 1)
            else:
                num_blocks = -(-end // bs)
                block_ids = self._tensor(seq.block_table[:num_blocks])
                seqs.append(SeqAttention(row, row + s.num_new_tokens, end, block_ids))
            prompt_rows.extend(row + q - start for q in s.prompt_positions())
            row += s.num_new_tokens
            if s.samples:  # the last real token's row, then one per draft token
                logits_indices.extend(range(row - 1 - s.num_spec, row))
        logits_indices += prompt_rows

        def tables(group: list[int]) -> torch.Tensor:
            width = max(decode_num_blocks[i] for i in group)
            rows = torch.tensor([decode_table_rows[i] for i in group], dtype=torch.long)
            return upload(self.block_rows.table[rows, :width], self.device)

        decodes = [
            DecodeBatch(
                self._tensor([decode_rows[i] for i in group]),
                tables(group),
                self._tensor([decode_lens[i] for i in group]),
            )
            for group in self._decode_groups(decode_num_blocks)
        ]
        ctx = AttentionContext(
            self._tensor(slots),
            seqs,
            bs,
            decodes,
            self.decode_kernel,
            prompt_block_rows=self.prompt_block_rows,
            prompt_softmax=self.prompt_softmax,
            kv_write=self.kv_write,
        )
        return StepBatch(self._tensor(input_ids), self._tensor(positions), ctx, self._tensor(logits_indices))

    def prepare_unified(self, scheduled: list[ScheduledSeq]) -> UnifiedHostBatch:
        """The step as host lists for the triton backend (every sequence alike)."""
        bs = self.block_size
        host = UnifiedHostBatch([], [], [], [], [0], [], [], 0, 0)
        prompt_rows: list[int] = []  # prompt_logprobs: after every sampling row
        for s in scheduled:
            prompt_rows.extend(host.query_starts[-1] + q - s.start for q in s.prompt_positions())
            end = s.start + s.num_new_tokens
            _append_tokens(s, bs, host.input_ids, host.positions, host.slots)
            row = host.query_starts[-1] + s.num_new_tokens
            host.query_starts.append(row)
            host.seq_lens.append(end)
            host.table_rows.append(self.block_rows.row(s.seq.seq_id, s.seq.block_table))
            host.max_query_len = max(host.max_query_len, s.num_new_tokens)
            host.max_blocks = max(host.max_blocks, -(-end // bs))
            if s.samples:
                host.logits_indices.extend(range(row - 1 - s.num_spec, row))
        host.logits_indices += prompt_rows
        host.num_prompt_rows = len(prompt_rows)
        return host

    def block_tables(self, host: UnifiedHostBatch) -> torch.Tensor:
        """[S, max_blocks] int32 on the host: the sequences' rows of the persistent table."""
        rows = torch.tensor(host.table_rows, dtype=torch.long)
        return self.block_rows.table[rows, : host.max_blocks].to(torch.int32)

    def to_step_batch(self, host: UnifiedHostBatch) -> StepBatch:
        unified = UnifiedBatch(
            self._tensor(host.query_starts, torch.int32),
            self._tensor(host.seq_lens, torch.int32),
            upload(self.block_tables(host), self.device),
            host.max_query_len,
        )
        ctx = AttentionContext(self._tensor(host.slots), [], self.block_size, unified=unified)
        return StepBatch(
            self._tensor(host.input_ids), self._tensor(host.positions), ctx, self._tensor(host.logits_indices)
        )

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=dtype), self.device)

    def _decode_groups(self, num_blocks: list[int]) -> list[list[int]]:
        if not num_blocks:
            return []
        if self.decode_kernel is not None:  # reads each context at its own length: no padding
            return [list(range(len(num_blocks)))]
        return group_by_length(num_blocks)


def _append_tokens(
    s: ScheduledSeq, block_size: int, input_ids: list[int], positions: list[int], slots: list[int]
) -> None:
    """A scheduled chunk's token ids (drafts last), positions and KV-cache slots."""
    seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
    input_ids.extend(seq.token_ids[start : end - s.num_spec])
    if s.num_spec:
        input_ids.extend(seq.spec_token_ids[: s.num_spec])
    positions.extend(range(start, end))
    table = seq.block_table
    slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))


class BlockTableRows:
    """Running sequences' block tables kept as rows of one tensor across steps (vLLM v1 keeps a
    persistent batch the same way), so a decode step copies only the blocks added since the last
    step instead of converting every sequence's whole table: that work grew with context length
    (1.3 ms a step for 128 sequences of 2,048 tokens).

    A row is rewritten whole when its sequence's table is a new list object (the block manager
    replaces the list when it frees or adopts blocks, and only ever extends it in place otherwise);
    it holds a reference to the list it mirrors, so that identity check cannot be fooled by a
    reused address. Entries past a sequence's length are stale block ids, which readers mask."""

    def __init__(self, num_columns: int, num_rows: int = 64) -> None:
        self.table = torch.zeros((num_rows, max(1, num_columns)), dtype=torch.long)
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: dict[int, tuple[int, list[int], int]] = {}  # seq_id -> (row, mirrored, written)

    def row(self, seq_id: int, blocks: list[int]) -> int:
        """The row holding `blocks` (the sequence's block table) as of now."""
        entry = self._rows.get(seq_id)
        if entry is not None and entry[1] is blocks and entry[2] <= len(blocks):
            row, _, start = entry
        else:
            row, start = (entry[0] if entry is not None else self._take()), 0
        if len(blocks) > start:
            if len(blocks) > self.table.shape[1]:
                extra = torch.zeros(
                    (self.table.shape[0], len(blocks) - self.table.shape[1]), dtype=torch.long
                )
                self.table = torch.cat([self.table, extra], dim=1)
            self.table[row, start : len(blocks)] = torch.tensor(blocks[start:], dtype=torch.long)
        self._rows[seq_id] = (row, blocks, len(blocks))
        return row

    def release(self, seq_id: int) -> None:
        entry = self._rows.pop(seq_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def _take(self) -> int:
        if not self._free:
            grown = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        return self._free.pop()


def group_by_length(num_blocks: list[int], max_waste: float = 0.5, max_group: int = 64) -> list[list[int]]:
    """Indices of decoding sequences grouped so each group's padded width (its longest block table)
    is at most (1 + max_waste) x its shortest: mixed lengths must not pad every short context to
    the longest one (attention cost and the gather grow with the padded width)."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if (
            group is None
            or len(group) >= max_group
            or num_blocks[i] > (1 + max_waste) * max(1, num_blocks[group[0]])
        ):
            groups.append([i])
        else:
            group.append(i)
    return groups
