"""Token sampling for a step's batch: penalties, greedy, temperature, top-k, top-p, min-p, seeds.

Rows that need nothing beyond greedy take one argmax; the rest are processed together. Seeded
sequences draw from their own torch.Generator (kept across steps), so their output does not depend
on what else shares the batch. Everything runs where the logits are: on a GPU the step waits for
the device once, when the chosen token ids come back, not once per sequence. `queue` and
`PendingSample.wait` are the two halves, so the engine can work on the host in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corral_engine.core.sequence import Sequence
from corral_engine.outputs import TokenLogprob
from corral_engine.structured.masks import TokenMasks, apply_token_masks


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(slots=True)
class PendingSample:
    """A batch's sampling, queued on the device: `wait` brings the token ids back."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [S] token ids, on the logits' device
    logprob_rows: list[int]  # the rows of `seqs` that asked for logprobs
    raw_logprobs: torch.Tensor | None  # [len(logprob_rows), V] log-probabilities, on the device

    def wait(self) -> SampleResult:
        token_ids = self.tokens.tolist()  # the step's one wait for the device
        logprobs: list[TokenLogprob | None] = [None] * len(self.seqs)
        if self.raw_logprobs is not None:
            raw = self.raw_logprobs.cpu()
            for i, row in enumerate(self.logprob_rows):
                k = self.seqs[row].request.params.logprobs
                assert k is not None
                logprobs[row] = token_logprob(raw[i], token_ids[row], k)
        return SampleResult(token_ids, logprobs)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: tuple[int, ...] = ()) -> None:
        """`eos_token_ids`: what min_tokens holds back, with each request's stop_token_ids."""
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self._generators: dict[torch.device, torch.Generator] = {}  # unseeded draws, per device
        self._seq_generators: dict[int, torch.Generator] = {}

    def release(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def _generator_for(self, seq: Sequence, device: torch.device) -> torch.Generator:
        seed = seq.request.params.seed
        if seed is None:
            gen = self._generators.get(device)
            if gen is None:
                gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
            return gen
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device).manual_seed((seed + seq.index) % (2**64))
            self._seq_generators[seq.seq_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None = None
    ) -> SampleResult:
        return self.queue(logits, seqs, masks).wait()

    def queue(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None = None
    ) -> PendingSample:
        """Queue the batch's sampling on the logits' device without waiting for it (the engine
        works on the host meanwhile). logits: [S, V] float32, one row per sequence in `seqs`
        order, on any device. `masks`: the allowed tokens of the constrained rows (structured
        outputs)."""
        raw_logprobs = None
        logprob_rows = [row for row, s in enumerate(seqs) if s.request.params.logprobs is not None]
        if logprob_rows:
            raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1)  # [L, V], copied in wait()
        adjusted = [
            row
            for row, s in enumerate(seqs)
            if s.request.params.has_penalties or s.request.params.has_token_rules
        ]
        if masks is not None or adjusted:
            logits = logits.clone()
        if masks is not None:
            apply_token_masks(logits, masks)
        for row in adjusted:
            seq = seqs[row]
            if seq.request.params.has_penalties:
                _apply_penalties(logits[row], seq)
            if seq.request.params.has_token_rules:
                self._apply_token_rules(logits[row], seq)
        tokens = torch.max(logits, dim=-1).indices  # [S]; greedy rows are done (max beats argmax on CPU)
        for row, seq in enumerate(seqs):
            params = seq.request.params
            if not params.is_greedy:
                tokens[row] = _sample_row(logits[row], seq, self._generator_for(seq, logits.device))
        return PendingSample(seqs, tokens, logprob_rows, raw_logprobs)

    def _apply_token_rules(self, row: torch.Tensor, seq: Sequence) -> None:  # row: [V], in place
        params = seq.request.params
        vocab = row.shape[0]
        if params.allowed_token_ids is not None:
            keep = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=row.device)
            kept = row.index_select(0, keep)
            row.fill_(float("-inf")).index_copy_(0, keep, kept)
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=row.device)
            bias = torch.tensor([b for _, b in params.logit_bias], dtype=row.dtype, device=row.device)
            row.index_add_(0, ids, bias)
        if seq.num_output_tokens < params.min_tokens:
            held = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < vocab]
            if held:
                row[torch.tensor(held, dtype=torch.long, device=row.device)] = float("-inf")


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:  # row: [V], modified in place
    params = seq.request.params
    vocab = row.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted({t for t in seq.token_ids if t < vocab}), dtype=torch.long, device=row.device
        )
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
    output = [t for t in seq.output_token_ids if t < vocab]
    if output and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=vocab).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _sample_row(row: torch.Tensor, seq: Sequence, generator: torch.Generator) -> torch.Tensor:
    """The drawn token id as a 0-d tensor on the row's device (no wait for the device here)."""
    params = seq.request.params
    row = row / params.temperature
    if params.top_k > 0 and params.top_k < row.shape[0]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cumulative - sorted_probs >= params.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised p is fine).
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / noise)


def token_logprob(row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """row: [V] log-probabilities on the CPU; the token's logprob and the top k."""
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(row, k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    logprob = row[token_id]
    rank = int((row > logprob).sum()) + 1
    return TokenLogprob(token_id=token_id, logprob=float(logprob), top=top, rank=rank)
