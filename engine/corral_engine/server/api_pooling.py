"""POST /pooling: vLLM's generic pooling API, `task` saying which output: "embed" (a vector, as
/v1/embeddings gives it), "classify" (a classifier's activated outputs, as /classify's probs), or
one a prompt token: "token_embed" (each token's hidden state, normalized as the model's pooler
says) or "token_classify" (a token classifier's label probabilities for each token). Without a
task, the model's own (vLLM's default): embed, classify or token_classify."""

from __future__ import annotations

from typing import Any, Literal, cast, get_args

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.outputs import RequestOutput
from corral_engine.pooling import classify_activation
from corral_engine.pooling_params import TOKEN_TASKS, PoolingParams, PoolingTask
from corral_engine.server import errors
from corral_engine.server.api_classify import ClassificationRequest
from corral_engine.server.api_embeddings import encode_vector
from corral_engine.server.context import ServerContext, new_id, now_s
from corral_engine.server.engine_client import embed_spec_of, problem_type_of
from corral_engine.server.generation import GenerationRun
from corral_engine.server.pooling_request import pooled_finals
from corral_engine.server.request_fields import REFUSED_COMMON, Refused, check_fields

_REFUSED = {
    "priority": REFUSED_COMMON["priority"],
    "mm_processor_kwargs": REFUSED_COMMON["mm_processor_kwargs"],
    "messages": Refused("pooling a conversation is not supported; send `input`"),
    "dimensions": Refused("dimensions is not supported on /pooling (vLLM's rule); use /v1/embeddings"),
}
_TASKS = get_args(PoolingTask)  # vLLM's: embed, classify, token_embed, token_classify


class PoolingRequest(ClassificationRequest):
    task: str | None = None  # None: the model's own task (vLLM's default)
    encoding_format: Literal["float", "base64"] = "float"
    # embed and token_embed: None leaves it to use_activation, then the model's pooler config.
    normalize: bool | None = None

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, _REFUSED)


def _params(ctx: ServerContext, req: PoolingRequest) -> PoolingParams:
    """The request's PoolingParams; a 400 for a task the model does not serve, saying why."""
    spec = embed_spec_of(ctx.engine, ctx.model_name)
    if spec.task is None:
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the Pooling API: it is a text generation "
            "model (--runner generate).",
            "model",
        )
    named = req.task or spec.task
    if named not in _TASKS:
        raise errors.invalid_request(
            f"Unsupported task {named!r}: the pooling tasks are {', '.join(_TASKS)}; the model "
            f"{ctx.model_name} serves {', '.join(spec.tasks)}.",
            "task",
        )
    task = cast(PoolingTask, named)
    if task not in spec.tasks:
        raise errors.invalid_request(f"Unsupported task {task!r}: {spec.refusal(task)}.", "task")
    if task in ("classify", "token_classify"):
        activation = classify_activation(problem_type_of(ctx.engine), req.is_activated())
        return PoolingParams(task=task, activation=activation)
    # vLLM's use_activation is an embedding's normalization; `normalize` (its older name) wins.
    given = (req.normalize, req.use_activation, req.softmax, req.activation)
    normalize = next((value for value in given if value is not None), None)
    return PoolingParams(task=task, normalize=normalize)


def _data(out: RequestOutput, task: str, encoding_format: str) -> list[float] | list[list[float]] | str:
    """One input's output: a vector, or for a token task its rows (one a prompt token), floats or
    base64 of them all flat (as vLLM encodes a tensor)."""
    flat = out.embedding or []  # pooled_finals saw each has its output
    if task not in TOKEN_TASKS or encoding_format == "base64":
        return encode_vector(flat, encoding_format)
    width = len(flat) // len(out.prompt_token_ids)
    return [flat[i : i + width] for i in range(0, len(flat), width)]


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
    data: list[dict[str, Any]] = [
        {"index": i, "object": "pooling", "data": _data(out, params.task, req.encoding_format)}
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
