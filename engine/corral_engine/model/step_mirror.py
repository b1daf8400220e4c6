"""What a tensor-parallel worker is told of each step: rank 0's scheduled chunks encoded
(`StepSeq`), and the stand-in sequences a worker rebuilds from them, so its batch, and its adapter
slots, are the same as rank 0's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from corral_engine.core.scheduler import ScheduledSeq
from corral_engine.core.sequence import Request, Sequence


@dataclass(frozen=True, slots=True)
class StepSeq:
    """What another rank needs of one scheduled sequence to build the same batch."""

    seq_id: int
    start: int
    num_new_tokens: int
    num_spec: int
    samples: bool
    tokens: list[int]  # the chunk's tokens, drafts last
    block_table: list[int]
    prompt_positions: range  # positions whose logits score prompt tokens (prompt_logprobs)
    lora_id: int | None  # the adapter the chunk runs with


@dataclass(slots=True)
class MirroredSeq(ScheduledSeq):
    """A scheduled chunk on a worker: its prompt-logprob positions and adapter come from rank 0
    (the request stays there)."""

    positions: range = range(0)
    adapter_id: int | None = None

    def prompt_positions(self) -> range:
        return self.positions

    def lora_id(self) -> int | None:
        return self.adapter_id


def encode_step(scheduled: list[ScheduledSeq]) -> list[StepSeq]:
    out = []
    for s in scheduled:
        seq, end = s.seq, s.start + s.num_new_tokens
        tokens = seq.token_ids[s.start : end - s.num_spec] + seq.spec_token_ids[: s.num_spec]
        positions = s.prompt_positions()
        args = (s.start, s.num_new_tokens, s.num_spec, s.samples, tokens, seq.block_table, positions)
        out.append(StepSeq(seq.seq_id, *args, s.lora_id()))
    return out


class SequenceMirror:
    """A worker's stand-ins for rank 0's sequences: the same ids, block tables and new tokens, so
    its BatchBuilder makes the same batch (block-table lists are extended in place, as the block
    manager does, so the persistent table rows are only appended to)."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def scheduled(self, steps: list[StepSeq]) -> list[ScheduledSeq]:
        out: list[ScheduledSeq] = []
        for st in steps:
            seq = self.seqs.get(st.seq_id)
            if seq is None:
                seq = Sequence(st.seq_id, cast(Request, None), 0, [], 0)
                self.seqs[st.seq_id] = seq
            table = seq.block_table
            if len(table) <= len(st.block_table) and st.block_table[: len(table)] == table:
                table.extend(st.block_table[len(table) :])
            else:
                seq.block_table = list(st.block_table)
            real = st.num_new_tokens - st.num_spec
            tokens = seq.token_ids
            del tokens[st.start :]
            tokens.extend([0] * (st.start - len(tokens)))  # positions this rank never saw (cached)
            tokens.extend(st.tokens[:real])
            if not st.samples:
                tokens.append(0)  # a prompt chunk short of the end: more tokens follow, none sampled
            seq.spec_token_ids = st.tokens[real:]
            args = (st.start, st.num_new_tokens, st.num_spec, st.prompt_positions, st.lora_id)
            out.append(MirroredSeq(seq, *args))
        return out

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
