"""POST /classify (and /v1/classify): vLLM's classification API over a sequence classifier
(*ForSequenceClassification, served with --runner pooling): each input one engine request, its
labels' probabilities (activated as config.json's problem_type says) and the likeliest label."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.outputs import RequestOutput
from corral_engine.pooling import classify_activation
from corral_engine.pooling_params import PoolingParams
from corral_engine.server import errors
from corral_engine.server.context import ServerContext, new_id, now_s
from corral_engine.server.engine_client import embed_spec_of, labels_of, problem_type_of, runner_of
from corral_engine.server.generation import GenerationRun
from corral_engine.server.pooling_request import PoolingInputRequest, pooled_finals
from corral_engine.server.request_fields import REFUSED_COMMON, Refused, check_fields

_REFUSED = {
    "priority": REFUSED_COMMON["priority"],
    "mm_processor_kwargs": REFUSED_COMMON["mm_processor_kwargs"],
    # vLLM's chat form of the request (a conversation rendered by the chat template).
    "messages": Refused("classification of a conversation is not supported; send `input`"),
}


class ClassificationRequest(PoolingInputRequest):
    # vLLM's: False gives the raw logits; activation and softmax are its deprecated names.
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, _REFUSED)

    def is_activated(self) -> bool:
        """Whether the outputs are activated: the first of use_activation, softmax, activation
        given (vLLM's order), else yes."""
        given = (self.use_activation, self.softmax, self.activation)
        return next((value for value in given if value is not None), True)


def _check_serves_classify(ctx: ServerContext) -> None:
    """A 400 unless the engine serves a sequence classifier, saying what it serves instead."""
    spec = embed_spec_of(ctx.engine, ctx.model_name)
    if "classify" in spec.tasks:
        return
    if spec.is_token_classifier:
        what = f"{spec.describe()}; use {spec.routes()}"
    elif runner_of(ctx.engine) == "pooling":
        what = "an embedding model (--runner pooling); use /v1/embeddings"
    else:
        what = "a text generation model (--runner generate)"
    raise errors.invalid_request(
        f"The model {ctx.model_name} does not support the Classification API: it is {what}. Serve "
        "a sequence classifier (*ForSequenceClassification) for labels.",
        "model",
    )


async def create_classify(ctx: ServerContext, request: Request) -> Response:
    req = await ctx.parse(request, ClassificationRequest)
    _check_serves_classify(ctx)
    prompts = await req.tokenize(ctx)
    activation = classify_activation(problem_type_of(ctx.engine), req.is_activated())
    request_id = new_id("classify")
    params = PoolingParams(task="classify", activation=activation)
    run = GenerationRun(ctx.engine, ctx.metrics, ctx.in_flight, request_id, prompts, params)
    finals = await pooled_finals(run, request, "classification")
    if finals is None:
        return Response(status_code=499)
    labels = labels_of(ctx.engine)
    num_tokens = sum(len(out.prompt_token_ids) for out in finals)
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": req.model,
            "data": [_item(i, out, labels) for i, out in enumerate(finals)],
            "usage": {
                "prompt_tokens": num_tokens,
                "total_tokens": num_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
    )


def _item(index: int, out: RequestOutput, labels: tuple[str | None, ...]) -> dict[str, Any]:
    """One input's result: the label of its largest output (the first of equals, as argmax)."""
    probs = out.embedding or []  # pooled_finals saw each has its outputs
    best = max(range(len(probs)), key=probs.__getitem__)
    label = labels[best] if best < len(labels) else None
    return {"index": index, "label": label, "probs": probs, "num_classes": len(probs)}
