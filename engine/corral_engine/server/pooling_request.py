"""What the pooling routes (/v1/embeddings, /classify, /v1/score's embedding-model path) share:
their inputs as the engine's prompts (texts tokenized or token ids as given, the last
`truncate_prompt_tokens` kept, each checked against the context), and their runs' pooled outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import Field, field_validator
from starlette.requests import Request

from corral_engine.outputs import RequestOutput
from corral_engine.server import errors
from corral_engine.server.api_models import TokenId, _Request
from corral_engine.server.context import ServerContext
from corral_engine.server.generation import GenerationRun, collect_unless_disconnected

# OpenAI's bound on the inputs of one request (each is an engine request here).
MAX_INPUTS = 2048
Input = str | list[str] | list[TokenId] | list[list[TokenId]]


class PoolingInputRequest(_Request):
    """The fields of /v1/embeddings and /classify that say what to run: one text or many, or
    token ids (one list or many), with vLLM's truncate_prompt_tokens and add_special_tokens."""

    model: str = Field(min_length=1)
    input: Input
    user: str | None = None
    # vLLM's: keep the input's last k tokens (-1: the model's context length).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool = True  # text inputs: as the tokenizer adds them (vLLM's default here)

    @field_validator("input")
    @classmethod
    def _check_input(cls, given: Input) -> Input:
        if isinstance(given, str):
            if not given:
                raise ValueError("must not be an empty string")
            return given
        if not given:
            raise ValueError("must not be empty")
        if isinstance(given[0], str | list):
            if len(given) > MAX_INPUTS:
                raise ValueError(f"at most {MAX_INPUTS} inputs per request")
            if any(not item for item in given):  # type: ignore[union-attr]
                raise ValueError("an input must not be empty")
        return given

    def inputs(self) -> list[str | list[int]]:
        """The request's inputs, one per engine request."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if all(isinstance(x, int) for x in given):
            return [list(given)]  # type: ignore[arg-type]
        return list(given)  # type: ignore[arg-type]

    async def tokenize(self, ctx: ServerContext) -> list[list[int]]:
        """Each input's token ids as the engine will see them, each checked against the context."""
        given = self.inputs()
        params = ["input" if len(given) == 1 else f"input.{i}" for i in range(len(given))]
        return await tokenize_inputs(
            ctx, given, params, self.truncate_prompt_tokens, add_special_tokens=self.add_special_tokens
        )


async def tokenize_inputs(
    ctx: ServerContext,
    items: Sequence[str | list[int]],
    params: list[str],
    truncate_prompt_tokens: int | None,
    noun: str = "input",
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """Each item's token ids; a 400 naming `params[i]` (and the item as `noun`) for one empty or
    longer than the context. truncate_prompt_tokens: keep the last k tokens (-1: the context)."""
    max_len = ctx.engine.max_model_len
    keep = max_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep is None:  # a text too long whatever its tokens is refused before tokenizing it
        for item, param in zip(items, params, strict=True):
            if isinstance(item, str):
                ctx.check_chars_fit(len(item), noun, param)
    encode = ctx.encode
    tokenizer = ctx.engine.tokenizer
    article = "An" if noun[0] in "aeiou" else "A"

    def tokenize() -> list[list[int]]:
        out = []
        for item, param in zip(items, params, strict=True):
            if isinstance(item, list):
                ids = item
            elif add_special_tokens:
                ids = encode(item)
            else:
                ids = list(tokenizer.encode(item, add_special_tokens=False))
            if keep is not None:
                ids = ids[-keep:]
            if not ids:
                raise errors.invalid_request(f"{article} {noun} must not be empty.", param)
            if len(ids) > max_len:
                raise too_long(max_len, noun, len(ids), param)
            out.append(ids)
        return out

    return await ctx.off_loop(tokenize, sum(len(item) for item in items if isinstance(item, str)))


def too_long(max_len: int, noun: str, num_tokens: int, param: str) -> errors.APIError:
    """The 400 for a prompt (`noun` names it) of `num_tokens` past the context."""
    return errors.invalid_request(
        f"This model's maximum context length is {max_len} tokens; the {noun} has {num_tokens}. "
        "Shorten it or set truncate_prompt_tokens.",
        param,
    )


async def pooled_finals(run: GenerationRun, request: Request, what: str) -> list[RequestOutput] | None:
    """The run's final outputs, each with its pooled output (`what` names it), or None where the
    client left first (its requests aborted)."""
    collected = await collect_unless_disconnected(run, request.receive)
    if collected is None:
        return None
    for out in collected.finals:
        if out.embedding is None:  # ended without its output: the engine is shutting down
            raise errors.APIError(
                503, f"The engine stopped before the {what} was computed.", type="service_unavailable_error"
            )
    return collected.finals
