"""Sampling parameters of one request, validated once when the request is built."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from corral_engine.errors import InvalidRequestError
from corral_engine.field_types import WrongType, checker, describe, got
from corral_engine.structured.spec import GrammarSpec

MAX_N = 16
# Temperatures below this sample greedily (vLLM's threshold): a logit over it can pass float32's range.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024  # distinct ids, as many as logit_bias may name
OutputKind = Literal["cumulative", "delta", "final_only"]
OUTPUT_KINDS: tuple[str, ...] = get_args(OutputKind)


class SamplingError(InvalidRequestError):
    """A sampling parameter is out of range; `param` names it as the OpenAI API spells it."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # None: as many as the context leaves after the prompt (and the KV cache holds), as vLLM's;
    # the request's own params carry that number once it is built (request_checks).
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k
    include_stop_str_in_output: bool = False
    # What a sequence's `text` and `token_ids` hold before it finishes: "cumulative", all so far
    # (as vLLM's default); "delta", nothing (only the delta_* fields), which saves the engine a copy
    # per step that grows with the output. A finished sequence's output is always complete.
    # "final_only" (vLLM's FINAL_ONLY, what a non-streamed response needs): no output until the
    # request ends, then one whose deltas hold everything (text, token ids, logprobs).
    output_kind: OutputKind = "cumulative"
    # Structured outputs: what every completion must match (compiled when the request is built).
    grammar: GrammarSpec | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias, in [-100, 100]);
    # given as a dict too, its keys ints or digit strings.
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (vLLM's)
    min_tokens: int = 0  # EOS and stop_token_ids are not sampled before this many output tokens
    # Logprobs of the prompt's tokens (each given the ones before it), with the top k alternatives.
    prompt_logprobs: int | None = None
    # vLLM's: special tokens (BOS, EOS, control tokens) are left out of the text, and, where kept,
    # spaced apart (slow tokenizers only: a fast tokenizer's own decoder places them).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Special tokens the text shows even so, by their text (a tool parser's markers, such as
    # Mistral's `[TOOL_CALLS]`): the server sets them, so the parser reads them and the client sees
    # no other special token. Texts the tokenizer has no special token for change nothing.
    shown_special_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        respelled = _respelled(self.stop, self.stop_token_ids, self.logit_bias)
        for name, check in _CHECKS.items():
            given = getattr(self, name)
            try:
                value = check(respelled.get(name, given))
            except WrongType:
                expected = _EXPECTED.get(name) or describe(_HINTS[name])
                raise SamplingError(f"{name} must be {expected}, got {got(given)}", name) from None
            object.__setattr__(self, name, value)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        # Each copy of an id cost every step (the stop check scans the ids, the sampler's mask is
        # built from them): a million copies of one id made every request in the batch crawl.
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        if self.allowed_token_ids is not None:  # then in the vocabulary (request_checks), so bounded
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(self.allowed_token_ids)))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str, param: str) -> SamplingError:
            return SamplingError(msg, param)

        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty"
            )
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty"
            )
        if not 1 <= self.n <= MAX_N:
            raise bad(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed must fit in 64 bits", "seed")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise bad("stop must be at most 16 non-empty strings", "stop")
        if any(t < 0 for t in self.stop_token_ids) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} distinct non-negative ids",
                "stop_token_ids",
            )
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias) or len(self.logit_bias) > 1024:
            raise bad("logit_bias takes at most 1024 tokens, each with a bias in [-100, 100]", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids must not be empty", "allowed_token_ids")
        if not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}", "prompt_logprobs")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}", "output_kind")

    @property
    def max_output_tokens(self) -> int:
        """max_tokens of a built request (where a None became what the context leaves)."""
        if self.max_tokens is None:
            raise ValueError("max_tokens is None: the request was not built (request_checks.check_request)")
        return self.max_tokens

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 or top_k 1; and, as vLLM, a temperature under GREEDY_BELOW, where
        logits / temperature overflow float32 and the draw would be noise, not the argmax."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_token_rules(self) -> bool:
        """Whether the sampler changes this request's logits beyond penalties (bias, allowed, min)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.min_tokens > 0

    @property
    def can_speculate(self) -> bool:
        """Drafts are verified greedily on raw logits, so only plain greedy requests speculate; not
        constrained ones (a draft the grammar or a token rule refuses must never be accepted)."""
        return (
            self.is_greedy
            and not self.has_penalties
            and self.logprobs is None
            and self.grammar is None
            and not self.has_token_rules
        )

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_HINTS: dict[str, Any] = typing.get_type_hints(SamplingParams)  # field -> annotation, resolved once
_CHECKS = {name: checker(hint) for name, hint in _HINTS.items()}
_EXPECTED = {"logit_bias": "a dict of token id (int) to bias (float)"}  # where not the annotation


def _respelled(stop: object, stop_token_ids: object, logit_bias: object) -> dict[str, object]:
    """vLLM's and OpenAI's spellings of these fields, as the fields hold them (field -> value, for
    those given so): a stop string for one stop, None for no stops, logit_bias as a dict whose
    keys are token ids, as ints or (JSON's keys) digit strings."""
    out: dict[str, object] = {}
    if isinstance(stop, str):
        out["stop"] = (stop,)
    elif stop is None:
        out["stop"] = ()
    if stop_token_ids is None:
        out["stop_token_ids"] = ()
    if isinstance(logit_bias, Mapping):
        out["logit_bias"] = tuple((_token_id(key), bias) for key, bias in logit_bias.items())
    return out


def _token_id(key: object) -> object:
    if not isinstance(key, str):
        return key  # for the type check to name, if not an int
    if re.fullmatch(r"[0-9]{1,12}", key) is None:
        raise SamplingError(f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias")
    return int(key)
