"""A step's model inputs: flattened token ids, positions, KV slots and the attention context,
built from the scheduled sequences; decode block tables are kept as rows across steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.model.attention import AttentionContext, DecodeBatch, SeqAttention
from corral_engine.model.native import PagedDecode


@dataclass(frozen=True, slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: AttentionContext
    logits_indices: torch.Tensor  # [S] rows of the batch whose next token is sampled


class BatchBuilder:
    """Turns a step's scheduled sequences into a StepBatch on `device`.

    `batched_decode` False attends decodes one sequence at a time (CORRAL_BATCHED_DECODE=0, for
    comparison); with a native `decode_kernel` all decodes go in one call at their own lengths,
    else in padded groups of similar length."""

    def __init__(
        self,
        block_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        batched_decode: bool,
        decode_kernel: PagedDecode | None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.batched_decode = batched_decode
        self.decode_kernel = decode_kernel
        self.block_rows = BlockTableRows(max_blocks_per_seq)

    def release(self, seq_id: int) -> None:
        """The sequence finished: its block-table row is free again."""
        self.block_rows.release(seq_id)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
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
        row = 0
        for s in scheduled:
            seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
            table = seq.block_table
            num_blocks = -(-end // bs)
            input_ids.extend(seq.token_ids[start : end - s.num_spec])
            if s.num_spec:
                input_ids.extend(seq.spec_token_ids[: s.num_spec])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if self.batched_decode and (s.num_new_tokens == 1 or s.num_spec):
                # A decode, or a decode with draft tokens to verify: each of those rows attends
                # like a decode over the context up to itself (its K/V is written first).
                table_row = self.block_rows.row(seq.seq_id, table)
                for j in range(s.num_new_tokens):
                    decode_rows.append(row + j)
                    decode_table_rows.append(table_row)
                    decode_num_blocks.append(-(-(start + j + 1) // bs))
                    decode_lens.append(start + j + 1)
            else:
                block_ids = torch.tensor(table[:num_blocks], dtype=torch.long, device=self.device)
                seqs.append(SeqAttention(row, row + s.num_new_tokens, end, block_ids))
            row += s.num_new_tokens
            if s.samples:  # the last real token's row, then one per draft token
                logits_indices.extend(range(row - 1 - s.num_spec, row))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        def tables(group: list[int]) -> torch.Tensor:
            width = max(decode_num_blocks[i] for i in group)
            rows = torch.tensor([decode_table_rows[i] for i in group], dtype=torch.long)
            return self.block_rows.table[rows, :width].to(self.device)

        decodes = [
            DecodeBatch(
                as_tensor([decode_rows[i] for i in group]),
                tables(group),
                as_tensor([decode_lens[i] for i in group]),
            )
            for group in self._decode_groups(decode_num_blocks)
        ]
        ctx = AttentionContext(as_tensor(slots), seqs, bs, decodes, self.decode_kernel)
        return StepBatch(as_tensor(input_ids), as_tensor(positions), ctx, as_tensor(logits_indices))

    def _decode_groups(self, num_blocks: list[int]) -> list[list[int]]:
        if not num_blocks:
            return []
        if self.decode_kernel is not None:  # reads each context at its own length: no padding
            return [list(range(len(num_blocks)))]
        return group_by_length(num_blocks)


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
