"""POST /v1/embeddings: texts or token ids in, a vector each out (OpenAI's Embeddings API, with
vLLM's truncate_prompt_tokens, add_special_tokens and normalize), on an engine served with
--runner pooling; and the 400 the generation routes answer on such an engine."""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.outputs import RequestOutput
from corral_engine.pooling_params import PoolingParams
from corral_engine.server import errors
from corral_engine.server.api_models import TokenId, _Request
from corral_engine.server.context import ServerContext, new_id, now_s
from corral_engine.server.engine_client import num_labels_of, runner_of
from corral_engine.server.generation import GenerationRun, collect_unless_disconnected
from corral_engine.server.request_fields import check_fields

# OpenAI's bound on the inputs of one request (each is an engine request here).
MAX_INPUTS = 2048
Input = str | list[str] | list[TokenId] | list[list[TokenId]]


class EmbeddingRequest(_Request):
    model: str = Field(min_length=1)
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # matryoshka models only: the vector's first N values
    user: str | None = None
    # vLLM's: keep the input's last k tokens (-1: the model's context length).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool = True  # text inputs: as the tokenizer adds them (vLLM's default here)
    normalize: bool | None = None  # vLLM's: None leaves it to the model's pooler config

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, {})

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


def refuse_generation(ctx: ServerContext, api: str) -> None:
    """On a pooling engine, the generation routes are a 400 saying what it serves instead."""
    if runner_of(ctx.engine) == "pooling":
        if num_labels_of(ctx.engine):
            what, routes = "a cross-encoder (classification) model", "/v1/score or /v1/rerank"
        else:
            what, routes = "an embedding model", "/v1/embeddings"
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the {api} API: it is {what} "
            f"(--runner pooling); use {routes}."
        )


async def _tokenize(ctx: ServerContext, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids as the engine will see them, each checked against the context."""
    given = req.inputs()
    max_len = ctx.engine.max_model_len
    keep = max_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    if keep is None:
        for i, item in enumerate(given):
            if isinstance(item, str):
                ctx.check_chars_fit(len(item), "input", _param(i, len(given)))

    def tokenize() -> list[list[int]]:
        out = []
        for i, item in enumerate(given):
            if isinstance(item, list):
                ids = item
            elif req.add_special_tokens:
                ids = ctx.encode(item)
            else:
                ids = list(ctx.engine.tokenizer.encode(item, add_special_tokens=False))
            if keep is not None:
                ids = ids[-keep:]
            if not ids:
                raise errors.invalid_request("An input must not be empty.", _param(i, len(given)))
            if len(ids) > max_len:
                raise errors.invalid_request(
                    f"This model's maximum context length is {max_len} tokens; the input has "
                    f"{len(ids)}. Shorten it or set truncate_prompt_tokens.",
                    _param(i, len(given)),
                )
            out.append(ids)
        return out

    return await ctx.off_loop(tokenize, sum(len(item) for item in given if isinstance(item, str)))


def _param(index: int, count: int) -> str:
    return "input" if count == 1 else f"input.{index}"


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of little-endian float32 bytes (what
    OpenAI's clients decode; the Python client asks for it by default)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embedding(ctx: ServerContext, request: Request) -> Response:
    req = await ctx.parse(request, EmbeddingRequest)
    if runner_of(ctx.engine) != "pooling":
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the Embeddings API: it generates text "
            "(--runner generate); serve an embedding model with --runner pooling.",
            "model",
        )
    if num_labels_of(ctx.engine):
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the Embeddings API: it is a cross-encoder "
            "(classification) model; use /v1/score or /v1/rerank.",
            "model",
        )
    prompts = await _tokenize(ctx, req)
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    request_id = new_id("embd")
    run = GenerationRun(ctx.engine, ctx.metrics, ctx.in_flight, request_id, prompts, params)
    collected = await collect_unless_disconnected(run, request.receive)
    if collected is None:
        return Response(status_code=499)
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": req.model,
            "data": [_item(i, out, req.encoding_format) for i, out in enumerate(collected.finals)],
            "usage": _usage(collected.finals),
        }
    )


def _item(index: int, out: RequestOutput, encoding_format: str) -> dict[str, Any]:
    if out.embedding is None:  # ended without its vector: the engine is shutting down
        raise errors.APIError(
            503, "The engine stopped before the embedding was computed.", type="service_unavailable_error"
        )
    return {"object": "embedding", "index": index, "embedding": encode_vector(out.embedding, encoding_format)}


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    num_tokens = sum(len(out.prompt_token_ids) for out in finals)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
