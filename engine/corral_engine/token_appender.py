"""A step's sampled tokens (its logits rows laid out first) appended to their sequences: stop tokens
checked, grammars advanced, speculative drafts verified and the next ones proposed, (async scheduling)
placeholders held for tokens still on the device, stop strings applied once detokenized, token counters."""

from __future__ import annotations

import time

import torch

from corral_engine.args import EngineArgs
from corral_engine.core import ngram
from corral_engine.core.scheduler import ScheduledSeq, Scheduler
from corral_engine.core.sequence import Request, Sequence
from corral_engine.model.batch import PENDING_TOKEN
from corral_engine.model.sampler import PendingSample, SampleResult
from corral_engine.output_processor import OutputProcessor
from corral_engine.outputs import EngineStats, StepLatencies
from corral_engine.structured.masks import advance

# Request id -> seq id -> how many tokens that sequence gained (what the text half reads).
Touched = dict[str, dict[int, int]]


class TokenAppender:
    def __init__(
        self,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        stats: EngineStats,
        args: EngineArgs,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.stats = stats  # the engine's counters, moved in place
        self.args = args
        self.max_model_len = max_model_len

    def append_sampled(
        self,
        plain: list[Sequence],
        result: SampleResult,
        drafts: list[tuple[ScheduledSeq, int]],
        logits: torch.Tensor | None,
        latencies: StepLatencies,
    ) -> Touched:
        """Append the step's new tokens (`drafts`: scheduled, first logits row); the token
        latencies they add go to `latencies`."""
        now = time.monotonic()
        touched: Touched = {}
        for seq, token_id, logprob in zip(plain, result.token_ids, result.logprobs, strict=True):
            if seq.is_finished:
                continue  # a stop string in the last step's text ended it: this token is dropped
            if logprob is not None:
                seq.logprobs.append(logprob)
            self._append_tokens(seq, [token_id], now, touched, latencies)
        for s, first_row in drafts:
            assert logits is not None
            if not s.seq.is_finished:
                tokens = self._verify(s, logits[first_row : first_row + 1 + s.num_spec])
                self._append_tokens(s.seq, tokens, now, touched, latencies)
        return touched

    def settle(self, inflight: PendingSample | None, latencies: StepLatencies) -> Touched:
        """Wait for the last step's tokens (`inflight`: async scheduling) and append them in
        place of their placeholders."""
        if inflight is None:
            return {}
        result = inflight.wait()
        self.drop_places(inflight.seqs)
        return self.append_sampled(inflight.seqs, result, [], None, latencies)

    def can_defer(self, plain: list[Sequence]) -> bool:
        """Whether these sequences' new tokens may stay on the device while the next step is
        scheduled (async scheduling): nothing the next schedule or batch reads depends on them
        (grammars, logprobs, forks) and no sequence ends by length with this token (it would be
        scheduled once more for nothing)."""
        if not plain:
            return False
        for seq in plain:
            params = seq.request.params
            if seq.grammar is not None or params.logprobs is not None or seq.request.pending_forks:
                return False
            if (
                seq.num_output_tokens + 1 >= params.max_output_tokens
                or seq.num_tokens + 1 >= self.max_model_len
            ):
                return False
        return True

    def hold_places(self, plain: list[Sequence]) -> None:
        """A placeholder token for each unfinished sequence, which `settle` replaces once the
        token is known (the next step's inputs take it on the device meanwhile)."""
        for seq in plain:
            if not seq.is_finished:
                seq.token_ids.append(PENDING_TOKEN)

    def drop_places(self, seqs: list[Sequence]) -> None:
        """Take back the placeholders `hold_places` left (their tokens are known, or dropped)."""
        for seq in seqs:
            if seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
                seq.token_ids.pop()

    def detokenize(self, request: Request, counts: dict[int, int]) -> None:
        """Detokenize the request's new tokens; a stop string ends its sequence there, and any
        tokens after it (accepted drafts) are dropped, as if they had never been appended."""
        children = request.metrics.children
        for seq in request.seqs:
            num_new = counts.get(seq.seq_id, 0)
            num_dropped = self.output_processor.detokenize(seq, num_new) if num_new else None
            if num_dropped is not None:
                if num_dropped:
                    del seq.token_ids[-num_dropped:]
                    del seq.logprobs[seq.num_output_tokens :]
                    counts[seq.seq_id] = num_new - num_dropped
                    self.stats.num_generation_tokens_total -= num_dropped
                if not seq.is_finished:
                    self.scheduler.finish(seq)
            if children is not None and num_new and seq.is_finished:
                # A child request (n > 1) ends with its text, as the whole request does when the
                # engine finishes it.
                children[seq.index].finished_time = time.monotonic()

    def _verify(self, s: ScheduledSeq, logits: torch.Tensor) -> list[int]:
        """Greedy verification: keep the drafts the model agrees with, plus its own next token."""
        seq = s.seq
        greedy = logits.argmax(dim=-1).tolist()  # [1 + num_spec]
        drafts = seq.spec_token_ids[: s.num_spec]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        seq.num_computed_tokens += accepted  # the accepted drafts' KV is valid; the rest is dropped
        self.stats.num_spec_proposed_total += len(drafts)
        self.stats.num_spec_accepted_total += accepted
        if drafts:
            self.stats.num_spec_drafts_total += 1
            per_pos = self.stats.num_spec_accepted_per_pos
            for position in range(accepted):
                per_pos[position] += 1
        return [*drafts[:accepted], greedy[accepted]]

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], now: float, touched: Touched, latencies: StepLatencies
    ) -> None:
        request = seq.request
        if seq.index == 0 and request.pending_forks:
            self.scheduler.fork_siblings(request)
        counts = touched.setdefault(request.request_id, {})
        seq.spec_token_ids = []
        num_appended = 0
        for token_id in tokens:
            seq.token_ids.append(token_id)
            num_appended += 1
            if seq.grammar is not None:
                advance(seq, token_id)
            if self.output_processor.check_stop_token(seq, token_id):  # stop strings: the text half
                self.scheduler.finish(seq)
            if seq.is_finished:
                break
        counts[seq.seq_id] = counts.get(seq.seq_id, 0) + num_appended
        self.stats.num_generation_tokens_total += num_appended
        if latencies.tokens_made(request.metrics, now, num_appended, seq.index):
            # Counted once its prefill is done, as vLLM does: the counter's rate is prefill work,
            # not arrivals (a burst of 200 requests would otherwise look like one busy interval).
            # Once per sequence, as vLLM v1 counts each child request's prompt.
            self.stats.num_prompt_tokens_total += len(request.prompt_token_ids)
        if not seq.is_finished and self.args.speculative and request.params.can_speculate:
            seq.spec_token_ids = self._propose(seq)

    def _propose(self, seq: Sequence) -> list[int]:
        """The next drafts from the sequence's own tokens (prompt lookup), as many as fit."""
        params = seq.request.params
        room = min(params.max_output_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return ngram.propose(
            seq.token_ids,
            min(self.args.num_speculative_tokens, room),
            min_ngram=self.args.prompt_lookup_min,
            max_ngram=self.args.prompt_lookup_max,
        )


def sampling_rows(
    scheduled: list[ScheduledSeq],
) -> tuple[list[Sequence], list[int], list[tuple[ScheduledSeq, int]], int]:
    """Count a step's computed tokens (drafts once verified) and lay out its logits rows: the
    sequences sampling one token and their rows, those with drafts (scheduled, first row), and
    how many rows sample."""
    plain: list[Sequence] = []
    plain_rows: list[int] = []
    drafts: list[tuple[ScheduledSeq, int]] = []
    row = 0
    for s in scheduled:
        seq = s.seq
        seq.num_computed_tokens += s.num_new_tokens - s.num_spec
        if not s.samples:
            continue
        if s.num_spec:
            drafts.append((s, row))
        else:
            plain.append(seq)
            plain_rows.append(row)
        row += 1 + s.num_spec
    return plain, plain_rows, drafts, row
