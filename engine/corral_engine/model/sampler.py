"""Token sampling for a step's batch: penalties, greedy, temperature, top-k, top-p, min-p, seeds.

Rows that need nothing beyond greedy take one argmax; the rest are processed together. Seeded
sequences draw from their own torch.Generator (kept across steps), so their output does not depend
on what else shares the batch. Everything runs where the logits are: on a GPU the step waits for
the device once, when the chosen token ids come back, not once per sequence. `queue` and
`PendingSample.wait` are the two halves, so the engine can work on the host in between.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from corral_engine.core.sequence import Sequence
from corral_engine.outputs import TokenLogprob
from corral_engine.sampling_params import SamplingParams
from corral_engine.structured.masks import TokenMasks, apply_token_masks


class ExponentialRace(Protocol):
    """native.FusedOps.exponential_race: (probs [R, V] float32 on the CPU, seeds [R] int64[,
    temperatures [R]: then the rows are logits]) -> [R] token ids."""

    def __call__(
        self, probs: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor | None = None
    ) -> torch.Tensor: ...


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
    # On a GPU: the ids' copy into pinned host memory, queued behind the sampling, and an event
    # after it, so `wait` waits for this step only, not for a next step queued since.
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def wait(self) -> SampleResult:
        if self.ready is not None and self.host_tokens is not None:
            self.ready.synchronize()  # the step's one wait for the device
            token_ids = self.host_tokens.tolist()
        else:
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
    def __init__(
        self,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        race: ExponentialRace | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`eos_token_ids`: what min_tokens holds back, with each request's stop_token_ids. `race`:
        the native exponential race for CPU logits (else PyTorch's exponential_ noise). `argmax`:
        the native greedy pick for [S, V] float32 CPU logits (native.FusedOps.argmax_rows), the
        same indices as torch.max's, faster."""
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.race = race
        self.argmax = argmax
        self._generators: dict[torch.device, torch.Generator] = {}  # unseeded draws, per device
        self._seq_generators: dict[int, torch.Generator] = {}

    def release(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of the rows whose request has no seed."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return gen

    def _generator_for(self, seq: Sequence, device: torch.device) -> torch.Generator:
        seed = seq.request.params.seed
        if seed is None:
            return self._shared_generator(device)
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
        sampled = [row for row, s in enumerate(seqs) if not s.request.params.is_greedy]
        if sampled and len(sampled) == len(seqs):  # no greedy row: no argmax over the vocabulary
            tokens = self._sample_rows(logits, None, seqs, sampled)
        else:
            tokens = self._greedy(logits)  # [S]: the greedy rows
            if sampled:
                tokens = self._sample_rows(logits, tokens, seqs, sampled)
        pending = PendingSample(seqs, tokens, logprob_rows, raw_logprobs)
        if tokens.device.type == "cuda":
            pending.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            pending.host_tokens.copy_(tokens, non_blocking=True)
            pending.ready = torch.cuda.Event()
            pending.ready.record()
        return pending

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        if self.argmax is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
            return self.argmax(logits)
        return torch.max(logits, dim=-1).indices  # max beats argmax on CPU

    def _sample_rows(
        self, logits: torch.Tensor, tokens: torch.Tensor | None, seqs: list[Sequence], rows: list[int]
    ) -> torch.Tensor:
        """`tokens` ([S], the greedy picks; None when every row is sampled) with the non-greedy
        `rows` sampled instead."""
        device = logits.device
        params = [seqs[row].request.params for row in rows]
        seeded = {
            i: self._generator_for(seqs[row], device)
            for i, row in enumerate(rows)
            if params[i].seed is not None
        }
        shared = self._shared_generator(device) if len(seeded) < len(rows) else None
        if len(rows) == len(seqs):  # the race applies to CPU logits only (_sample_pass)
            return sample_rows(logits, params, shared, seeded, self.race)
        assert tokens is not None
        index = _to_device(rows, torch.long, device)
        drawn = sample_rows(logits.index_select(0, index), params, shared, seeded, self.race)
        return tokens.index_copy(0, index, drawn)

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


# A pass samples at most this many logits (rows x vocabulary) at once: its temporaries, some
# tens of bytes per logit, stay bounded however large max_num_seqs is (about 0.6 GiB here).
MAX_SAMPLED_LOGITS = 1 << 24


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    shared: torch.Generator | None,
    seeded: dict[int, torch.Generator],
    race: ExponentialRace | None = None,
) -> torch.Tensor:
    """The drawn token ids, [R] int64 on the logits' device, of R rows sampled together (a fixed
    number of kernels per MAX_SAMPLED_LOGITS, however many rows, and no wait for the device).
    logits: [R, V] float32, one row per `params`. Row i draws its noise from `seeded[i]` (a [V]
    draw of its own, as a row alone would) or else from `shared`. `race` (CPU logits): the native
    exponential race, each row's noise from one seed drawn from its generator."""
    step = max(1, MAX_SAMPLED_LOGITS // logits.shape[1])
    if len(params) <= step:
        return _sample_pass(logits, params, shared, seeded, race)
    passes = []
    for first in range(0, len(params), step):
        own = {row - first: gen for row, gen in seeded.items() if first <= row < first + step}
        rows = slice(first, first + step)
        passes.append(_sample_pass(logits[rows], params[rows], shared, own, race))
    return torch.cat(passes)


def _sample_pass(
    logits: torch.Tensor,
    params: list[SamplingParams],
    shared: torch.Generator | None,
    seeded: dict[int, torch.Generator],
    race: ExponentialRace | None = None,
) -> torch.Tensor:
    """sample_rows for one pass: `shared` draws all the rows' noise at once.

    Per row, in this order: logits / temperature; top_k keeps the logits >= the k-th largest;
    softmax; top_p keeps the smallest most-probable set reaching top_p; min_p drops probabilities
    below min_p x the largest; then the exponential race. Every step is row-wise with a result
    that does not depend on R, so a seeded row's token does not depend on what shares the batch."""
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    kmax = max(top_k)
    table = _to_device(  # [R, 4]: temperature, top_p (inf: none), min_p, k-th column of topk(kmax)
        [
            [p.temperature, p.top_p if p.top_p < 1.0 else math.inf, p.min_p, k - 1 if k else kmax]
            for p, k in zip(params, top_k, strict=True)
        ],
        torch.float32,
        logits.device,
    )
    cpu_race = race if logits.device.type == "cpu" else None
    if cpu_race is not None and not kmax and all(p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        # A temperature alone (OpenAI's default): the race reads the logits and does the softmax
        # itself, the same draws without two [R, V] tensors written and read back.
        return cpu_race(logits, _row_seeds(len(params), shared, seeded), table[:, 0])
    x = logits / table[:, 0:1]  # [R, V]
    if kmax:
        # Column kmax is -inf, the "k-th largest" of rows without top_k: it masks nothing.
        ranked = F.pad(torch.topk(x, kmax, dim=-1).values, (0, 1), value=-math.inf)  # [R, kmax + 1]
        x = x.masked_fill(x < ranked.gather(1, table[:, 3:4].long()), -math.inf)
    probs = torch.softmax(x, dim=-1)  # [R, V]
    if any(p.top_p < 1.0 for p in params):
        # Probabilities, not logits, are sorted: top_k's zeros make the sort cheap on a CPU.
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [R, V] each
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cumulative - sorted_probs >= table[:, 1:2]  # keep the smallest set reaching top_p
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0.0 for p in params):
        floor = table[:, 2:3] * probs.max(dim=-1, keepdim=True).values  # [R, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised p is fine).
    if cpu_race is not None:
        return cpu_race(probs, _row_seeds(len(params), shared, seeded))
    noise = torch.empty_like(probs)
    if shared is not None:
        noise.exponential_(1.0, generator=shared)  # seeded rows' share is overwritten below
    for row, gen in seeded.items():
        noise[row].exponential_(1.0, generator=gen)
    return torch.argmax(probs / noise, dim=-1)


def _row_seeds(
    num_rows: int, shared: torch.Generator | None, seeded: dict[int, torch.Generator]
) -> torch.Tensor:
    """One 62-bit seed per row for the native race: from the row's own generator when its request
    has a seed (so its draws repeat whatever shares the batch), else all from `shared`."""
    seeds = torch.empty(num_rows, dtype=torch.long)
    if shared is not None:
        torch.randint(0, 1 << 62, (num_rows,), generator=shared, out=seeds)
    for row, gen in seeded.items():
        seeds[row] = torch.randint(0, 1 << 62, (1,), generator=gen)
    return seeds


def _to_device(
    values: list[list[float]] | list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    # From pageable memory a non-blocking copy is staged at once and does not wait for the device.
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def token_logprob(row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """row: [V] log-probabilities on the CPU; the token's logprob and the top k."""
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(row, k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    logprob = row[token_id]
    rank = int((row > logprob).sum()) + 1
    return TokenLogprob(token_id=token_id, logprob=float(logprob), top=top, rank=rank)


def record_prompt_logprobs(scored: list[tuple[Sequence, range]], logits: torch.Tensor) -> None:
    """Append to each scored sequence the logprobs of its prompt tokens at `positions` (logits:
    [rows, V], a row per position, in order; each row predicts the token after its position)."""
    raw = torch.log_softmax(logits, dim=-1).cpu()  # [rows, V]
    i = 0
    for seq, positions in scored:
        k = seq.request.params.prompt_logprobs or 0
        for q in positions:
            seq.prompt_logprobs.append(token_logprob(raw[i], seq.token_ids[q + 1], k))
            i += 1
