"""POST /pooling: vLLM's generic pooling API for a whole sequence's output, with `task` saying
which: "embed" (an embedding model's vector, as /v1/embeddings gives it) or "classify" (a
classifier's activated outputs, as /classify's probs). vLLM's default, per-token outputs
(token_embed, token_classify), is not computed here: `task` is required."""

from __future__ import annotations

from typing import Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.pooling import classify_activation
from corral_engine.pooling_params import PoolingParams
from corral_engine.server import errors
from corral_engine.server.api_classify import ClassificationRequest
from corral_engine.server.api_embeddings import encode_vector
from corral_engine.server.context import ServerContext, new_id, now_s
from corral_engine.server.engine_client import num_labels_of, problem_type_of, runner_of
from corral_engine.server.generation import GenerationRun
from corral_engine.server.pooling_request import pooled_finals
from corral_engine.server.request_fields import REFUSED_COMMON, Refused, check_fields

_REFUSED = {
    "priority": REFUSED_COMMON["priority"],
    "mm_processor_kwargs": REFUSED_COMMON["mm_processor_kwargs"],
    "messages": Refused("pooling a conversation is not supported; send `input`"),
    "dimensions": Refused("dimensions is not supported on /pooling (vLLM's rule); use /v1/embeddings"),
}


class PoolingRequest(ClassificationRequest):
    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    normalize: bool | None = None  # task embed: None leaves it to the model's pooler config

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, _REFUSED)


def _served_task(ctx: ServerContext) -> str | None:
    """The task this engine pools for: classify on a classifier, embed on an embedding model."""
    if runner_of(ctx.engine) != "pooling":
        return None
    return "classify" if num_labels_of(ctx.engine) else "embed"


def _params(ctx: ServerContext, req: PoolingRequest) -> PoolingParams:
    """The request's PoolingParams; a 400 for a task missing or other than the engine's."""
    served = _served_task(ctx)
    if served is None:
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the Pooling API: it is a text generation "
            "model (--runner generate).",
            "model",
        )
    if req.task != served:
        said = "is required" if req.task is None else f"{req.task!r} is not served"
        raise errors.invalid_request(
            f"task {said}: the model {ctx.model_name} pools for task {served!r}. Per-token outputs "
            "(vLLM's default, token_embed or token_classify) are not computed by this engine.",
            "task",
        )
    if served == "classify":
        activation = classify_activation(problem_type_of(ctx.engine), req.is_activated())
        return PoolingParams(task="classify", activation=activation)
    return PoolingParams(normalize=req.normalize)


async def create_pooling(ctx: ServerContext, request: Request) -> Response:
    req = await ctx.parse(request, PoolingRequest)
    params = _params(ctx, req)
    prompts = await req.tokenize(ctx)
    request_id = new_id("pool")
    run = GenerationRun(ctx.engine, ctx.metrics, ctx.in_flight, request_id, prompts, params)
    finals = await pooled_finals(run, request, "pooled output")
    if finals is None:
        return Response(status_code=499)
    num_tokens = sum(len(out.prompt_token_ids) for out in finals)
    data = [
        {"index": i, "object": "pooling", "data": encode_vector(out.embedding or [], req.encoding_format)}
        for i, out in enumerate(finals)
    ]
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": req.model,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )
