"""Structured outputs on a simulated replica: the engine's own grammars (`structured.compiler`,
llguidance) compile a request's constraint, so what the engine refuses is refused here, and choose
each token of a constrained sequence from the grammar's token mask, since there is no model.

A token is a random one the grammar allows, with two rules so outputs end as short documents
rather than at max_tokens: EOS as soon as the grammar is complete (and min_tokens is met), and,
a quarter of the time when one is allowed, a closing token (a quote or bracket: `"`, `}`, `]`, `)`),
which ends a string, an object or an array. Random, but repeatable: drawn from the request's
seed (or its prompt), the sequence's index (not for a greedy request) and its length.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from corral_engine.core.sequence import Request, Sequence
from corral_engine.errors import InvalidRequestError
from corral_engine.structured.compiler import GrammarCompiler

CLOSING_CHARS = frozenset('"}])')
CLOSE_PROBABILITY = 0.25
_NUM_TRIES = 16  # random ids tried before a mask is unpacked


class SimGrammars:
    """Shared by a process's replicas (they share a tokenizer): the vocabulary llguidance builds
    (2-3 s for 128k tokens) and the compiled grammars are made once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)

    def attach(self, request: Request) -> None:
        """Compile a constrained request's grammar (InvalidRequestError, the engine's 400, when it
        does not compile) and give each of its sequences a matcher."""
        if request.params.grammar is None:
            return
        if not self.eos_token_ids:
            raise InvalidRequestError(
                "structured outputs need an EOS token: this tokenizer names none (config.json's "
                "eos_token_id or tokenizer_config.json's eos_token)",
                request.params.grammar.param,
            )
        self.compiler.attach(request)

    def next_token(self, seq: Sequence) -> int:
        """The constrained sequence's next token; the caller appends it and calls `advance`."""
        mask = seq.grammar.compute_bitmask()  # bit t of the little-endian words allows token t
        params = seq.request.params
        may_end = seq.num_output_tokens >= params.min_tokens
        if may_end:
            for eos in self.eos_token_ids:
                if _allows(mask, eos):
                    return eos
        index = 0 if params.is_greedy else seq.index  # the engine's greedy siblings are equal
        rng = random.Random(hash((_seed(seq.request), index, seq.num_output_tokens)))
        closers = [t for t in self._closing_tokens if _allows(mask, t)]
        if closers and rng.random() < CLOSE_PROBABILITY:
            return rng.choice(closers)
        token_id = _random_allowed(mask, rng, () if may_end else self.eos_token_ids)
        # None: only EOS is left (min_tokens asks for more than the grammar allows).
        return self.eos_token_ids[0] if token_id is None else token_id

    @staticmethod
    def advance(seq: Sequence, token_id: int) -> None:
        """Feed the chosen token to the sequence's grammar (chosen from its mask: always allowed)."""
        seq.grammar.consume_token(token_id)

    @functools.cached_property
    def _closing_tokens(self) -> list[int]:
        """Tokens spelled with closing characters alone (byte-level and SentencePiece vocabularies
        keep ASCII punctuation as itself)."""
        vocab = self.tokenizer.backend_tokenizer.get_vocab()
        return sorted(i for text, i in vocab.items() if text and set(text) <= CLOSING_CHARS)


def _allows(mask: bytes, token_id: int) -> bool:
    return token_id >> 3 < len(mask) and bool(mask[token_id >> 3] >> (token_id & 7) & 1)


def _random_allowed(mask: bytes, rng: random.Random, excluded: tuple[int, ...]) -> int | None:
    """A uniformly random token the mask allows, less `excluded`; None when there is none.
    Random ids are tried first: inside a JSON string nearly every token is allowed, and unpacking
    a whole 128k vocabulary's mask costs ~0.4 ms. A sparse mask (digits only) is unpacked where
    it allows something."""
    for _ in range(_NUM_TRIES):
        token_id = rng.randrange(len(mask) * 8)
        if _allows(mask, token_id) and token_id not in excluded:
            return token_id
    import numpy as np

    mask_bytes = np.frombuffer(mask, dtype=np.uint8)
    nonzero = np.flatnonzero(mask_bytes)  # only the bytes that allow something are unpacked
    rows, bits = np.nonzero(np.unpackbits(mask_bytes[nonzero, None], axis=1, bitorder="little"))
    allowed = np.setdiff1d(nonzero[rows] * 8 + bits, excluded)
    return int(allowed[rng.randrange(len(allowed))]) if len(allowed) else None


def _seed(request: Request) -> int:
    """The request's seed, else one from its prompt's start (the same prompt, the same output)."""
    seed = request.params.seed
    return seed if seed is not None else hash(tuple(request.prompt_token_ids[:64]))
