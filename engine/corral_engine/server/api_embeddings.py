"""POST /v1/embeddings: texts or token ids in, a vector each out (OpenAI's Embeddings API, with
vLLM's truncate_prompt_tokens, add_special_tokens and normalize), on an engine served with
--runner pooling; and the 400 the generation routes answer on such an engine."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.outputs import RequestOutput
from corral_engine.pooling_params import PoolingParams
from corral_engine.server import errors
from corral_engine.server.context import ServerContext, new_id, now_s
from corral_engine.server.engine_client import embed_spec_of, runner_of
from corral_engine.server.generation import GenerationRun
from corral_engine.server.pooling_request import PoolingInputRequest, pooled_finals
from corral_engine.server.request_fields import check_fields


class EmbeddingRequest(PoolingInputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # matryoshka models only: the vector's first N values
    normalize: bool | None = None  # vLLM's: None leaves it to the model's pooler config

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, {})


def refuse_generation(ctx: ServerContext, api: str) -> None:
    """On a pooling engine, the generation routes are a 400 saying what it serves instead."""
    if runner_of(ctx.engine) == "pooling":
        spec = embed_spec_of(ctx.engine, ctx.model_name)
        what, routes = spec.describe(), spec.routes()
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the {api} API: it is {what} "
            f"(--runner pooling); use {routes}."
        )


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
    spec = embed_spec_of(ctx.engine, ctx.model_name)
    if spec.num_labels:
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the Embeddings API: it is "
            f"{spec.describe()}; use {spec.routes()}.",
            "model",
        )
    prompts = await req.tokenize(ctx)
    pooling = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    request_id = new_id("embd")
    run = GenerationRun(ctx.engine, ctx.metrics, ctx.in_flight, request_id, prompts, pooling)
    finals = await pooled_finals(run, request, "embedding")
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": req.model,
            "data": [_item(i, out, req.encoding_format) for i, out in enumerate(finals)],
            "usage": _usage(finals),
        }
    )


def _item(index: int, out: RequestOutput, encoding_format: str) -> dict[str, Any]:
    vector = out.embedding or []  # pooled_finals saw each has its vector
    return {"object": "embedding", "index": index, "embedding": encode_vector(vector, encoding_format)}


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    num_tokens = sum(len(out.prompt_token_ids) for out in finals)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
