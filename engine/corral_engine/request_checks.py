"""What a request must satisfy before it is queued: a prompt that fits the context and the KV
cache, and token ids (prompt, logit_bias, allowed_token_ids) inside the vocabulary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from corral_engine.errors import InvalidRequestError
from corral_engine.sampling_params import SamplingParams


class KvCapacity(Protocol):
    """What the check needs of the KV cache (the engine's BlockManager, or a `KvShape`)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def blocks_for_tokens(self, num_tokens: int) -> int: ...


@dataclass(frozen=True, slots=True)
class KvShape:
    """A KV cache's size alone, for checking requests away from the engine (its own process)."""

    num_blocks: int
    block_size: int

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def check_request(
    token_ids: list[int], params: SamplingParams, max_model_len: int, vocab: int, bm: KvCapacity
) -> SamplingParams:
    """The request's params, refused (InvalidRequestError) where it cannot run; a max_tokens of
    None becomes what the prompt leaves of the context and of the KV cache."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab for t in token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
    if any(not 0 <= t < vocab for t, _ in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    if params.allowed_token_ids is not None and any(not 0 <= t < vocab for t in params.allowed_token_ids):
        raise InvalidRequestError(f"allowed_token_ids must be in [0, {vocab})", "allowed_token_ids")
    num = len(token_ids)
    if num >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num} "
            "and leaves no room for output.",
            "prompt",
        )
    if params.max_tokens is not None and num + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num} "
            f"and max_tokens asks for {params.max_tokens} more.",
            "max_tokens",
        )
    need = bm.blocks_for_tokens(num + 1)  # the prompt and its first output token
    if need > bm.num_blocks:  # whatever max_tokens says
        raise InvalidRequestError(
            f"the prompt has {num} tokens and needs {need} KV blocks with its first output token; "
            f"the cache has {bm.num_blocks}",
            "prompt",
        )
    if params.max_tokens is None:  # both fit at least one output token (checked above)
        room = min(max_model_len, bm.num_blocks * bm.block_size) - num
        return dataclasses.replace(params, max_tokens=room)
    need = bm.blocks_for_tokens(num + params.max_tokens)
    if need > bm.num_blocks:
        raise InvalidRequestError(
            f"the request needs {need} KV blocks; the cache has {bm.num_blocks}", "max_tokens"
        )
    return params


def check_pooling_prompt(token_ids: list[int], max_model_len: int, vocab: int, bm: KvCapacity) -> None:
    """A pooling (embedding) request's prompt, refused (InvalidRequestError) where it cannot run:
    it may fill the whole context, as it makes no output token."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab for t in token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
    num = len(token_ids)
    if num > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num}.",
            "input",
        )
    need = bm.blocks_for_tokens(num)
    if need > bm.num_blocks:
        raise InvalidRequestError(
            f"the prompt has {num} tokens and needs {need} KV blocks; the cache has {bm.num_blocks}", "input"
        )
