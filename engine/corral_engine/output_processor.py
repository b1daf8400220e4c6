"""From sampled tokens to what a client sees: incremental text, stop strings and stop tokens, and
each request's output of a step (vLLM v1 keeps the same concept apart from the engine core)."""

from __future__ import annotations

import functools
from typing import Any

from corral_engine.core.sequence import Request, Sequence
from corral_engine.outputs import CompletionOutput, RequestOutput
from corral_engine.tokenizer import IncrementalDetokenizer, special_tokens


class OutputProcessor:
    def __init__(
        self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_model_len: int, stream_interval: int = 1
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}  # seq_id -> its detokenizer

    def add(self, request: Request) -> None:
        params = request.params
        skip, hidden = params.skip_special_tokens, frozenset[int]()
        if skip and params.shown_special_tokens:
            specials = special_tokens(self.tokenizer)
            shown = {specials[t] for t in params.shown_special_tokens if t in specials}
            if shown:  # the others are left out by id, so the decode itself skips none
                skip, hidden = False, self.special_ids - shown
        for seq in request.seqs:
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                skip,
                params.spaces_between_special_tokens,
                hidden,
            )

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(special_tokens(self.tokenizer).values())

    def release(self, seq_id: int) -> None:
        self._detokenizers.pop(seq_id, None)

    def append_token(self, seq: Sequence, token_id: int) -> bool:
        """Both halves below for `seq`'s newest token (already in seq.token_ids); True when the
        sequence is now finished (its finish and stop reasons are set)."""
        is_finished = self.check_stop_token(seq, token_id)
        return self.detokenize(seq, 1) is not None or is_finished

    def check_stop_token(self, seq: Sequence, token_id: int) -> bool:
        """The stop rules the next schedule needs at once (EOS, stop_token_ids, max_tokens, the
        context length) for `seq`'s newest token; True when one ended it (reasons set)."""
        params = seq.request.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token_id in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
        elif seq.num_output_tokens >= params.max_output_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        else:
            return False
        return True

    def detokenize(self, seq: Sequence, num_new: int) -> int | None:
        """The text half: detokenize `seq`'s newest `num_new` tokens, in order, and look for stop
        strings. When one matched it ends the sequence (reasons set, over any a stop token set) and
        the return value is how many of those tokens came after it (to drop); else None, and a
        sequence the stop tokens ended has its pending text flushed."""
        detok = self._detokenizers[seq.seq_id]
        new_ids = seq.token_ids[len(seq.token_ids) - num_new :]
        if self._ends_on_special_stop(seq):
            new_ids = new_ids[:-1]
        for i, token_id in enumerate(new_ids):
            stop_str = detok.add_token(token_id)
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                return num_new - 1 - i
        if seq.finish_reason is not None:
            detok.flush()
        return None

    def _ends_on_special_stop(self, seq: Sequence) -> bool:
        """Whether `seq` ended on a special token that stops it (EOS, a stop_token_id), which its
        text leaves out even where it shows special tokens (as vLLM), unless
        include_stop_str_in_output asks for it. (It is the sequence's last token.)"""
        return (
            seq.finish_reason == "stop"
            and not isinstance(seq.stop_reason, str)
            and not seq.request.params.include_stop_str_in_output
            and seq.token_ids[-1] in self.special_ids
        )

    def due(self, request: Request, counts: dict[int, int], is_finished: bool) -> dict[int, int] | None:
        """The stream interval (vLLM's `--stream-interval`), after `counts` (seq_id -> tokens
        gained this step) are detokenized: the counts the request's output carries now, this
        step's and those held back before, or None when the output waits for a later step. A
        "delta" request's output goes out with each sequence's first token and its last, and once
        a sequence gained `stream_interval` tokens since the last output; "cumulative" ones go out
        every step. Text, token ids and logprobs held back go out in the next output's deltas.
        A "final_only" request has one output, at its end."""
        if request.params.output_kind == "final_only":
            return counts if is_finished else None
        if self.stream_interval == 1:
            return counts
        held = request.held_counts
        if held is not None:
            request.held_counts = None
            for seq_id, n in counts.items():
                held[seq_id] = held.get(seq_id, 0) + n
            counts = held
        started = request.started_seq_ids
        if started is None:
            started = request.started_seq_ids = set()
        if (
            is_finished
            or request.params.output_kind != "delta"
            or max(counts.values(), default=0) >= self.stream_interval
            or not started.issuperset(counts)
            or any(seq.is_finished and seq.seq_id in counts for seq in request.seqs)
        ):
            started.update(counts)
            return counts
        request.held_counts = counts
        return None

    def build_output(self, request: Request, touched: dict[int, int], is_finished: bool) -> RequestOutput:
        """The request's output after a step; `touched`: seq_id -> tokens it gained this step."""
        outs = []
        kind = request.params.output_kind
        is_cumulative = kind == "cumulative"
        for seq in request.seqs:
            detok = self._detokenizers[seq.seq_id]
            delta_text = detok.take_delta(seq.is_finished)
            # A final-only request's one output is a delta from nothing: every token it has.
            new = seq.num_output_tokens if kind == "final_only" else touched.get(seq.seq_id, 0)
            delta_ids = seq.token_ids[-new:] if new else []  # the newest tokens are outputs
            is_whole = is_cumulative or seq.is_finished  # "delta": only what is new, until the end
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=detok.text[: detok.num_emitted_chars] if is_whole else "",
                    token_ids=seq.output_token_ids if is_whole else [],
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_logprobs=seq.logprobs[-new:] if new and seq.logprobs else None,
                )
            )
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None:
            prompt_logprobs = [None, *request.seqs[0].prompt_logprobs]
        return RequestOutput(
            request.request_id, request.prompt_token_ids, outs, is_finished, request.metrics, prompt_logprobs
        )
