"""POST /v1/score (and /score) and /v1/rerank (and /rerank, /v2/rerank: Jina and Cohere clients'):
vLLM's APIs over a cross-encoder (a reranker, served with --runner pooling): each pair is one engine
request, the tokenizer's pair encoding, its token types sent as where the second text starts; or,
as vLLM does, over an embedding model: each distinct text embedded once, a pair's score the cosine
similarity of its two vectors. A cross-encoder's scores are its activated outputs (a sigmoid for
one label), or with vLLM's `use_activation: false` its raw logits."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.outputs import RequestOutput
from corral_engine.pooling_params import ClassifierActivation, PoolingParams
from corral_engine.server import errors
from corral_engine.server.api_models import _Request
from corral_engine.server.context import ServerContext, new_id, now_s
from corral_engine.server.engine_client import embed_spec_of, num_labels_of, runner_of
from corral_engine.server.generation import GenerationRun
from corral_engine.server.pooling_request import MAX_INPUTS, pooled_finals, tokenize_inputs, too_long
from corral_engine.server.request_fields import REFUSED_COMMON, check_fields

# vLLM's score and rerank fields Corral does not implement; a value asking for nothing is accepted.
_REFUSED = {
    "priority": REFUSED_COMMON["priority"],
    "mm_processor_kwargs": REFUSED_COMMON["mm_processor_kwargs"],
}
Texts = str | list[str]
# vLLM's: keep at most k tokens of each pair, the longer text cut first (-1: the model's context).
TruncateTokens = Annotated[int, Field(ge=-1)] | None


class _PairRequest(_Request):
    model: str = Field(min_length=1)
    truncate_prompt_tokens: TruncateTokens = None
    # vLLM's: False gives a cross-encoder's raw logits (an embedding model's cosine is unchanged);
    # activation and softmax are its deprecated names.
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, _REFUSED)

    def activation_kind(self) -> ClassifierActivation:
        """How a cross-encoder's logits become scores: the first of use_activation, softmax,
        activation given (vLLM's order), else activated."""
        given = (self.use_activation, self.softmax, self.activation)
        return "auto" if next((value for value in given if value is not None), True) else "none"


class ScoreRequest(_PairRequest):
    text_1: Texts
    text_2: Texts


class RerankRequest(_PairRequest):
    query: str
    documents: list[str]
    top_n: int = 0  # the best N results; 0 (vLLM's default) or less: all of them
    return_documents: bool = True  # Jina's and Cohere's field; vLLM always returns them


def _pairs(text_1: Texts, text_2: Texts, names: tuple[str, str]) -> list[tuple[str, str]]:
    """vLLM's pairing: 1:1, 1:N (the one first text with each second) or N:N."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise errors.invalid_request("At least one text element must be given.", names[0])
    if not second:
        raise errors.invalid_request("At least one text_pair element must be given.", names[1])
    if len(first) > 1 and len(first) != len(second):
        raise errors.invalid_request("Input lengths must be either 1:1, 1:N or N:N.", names[0])
    if len(second) > MAX_INPUTS:
        raise errors.invalid_request(f"at most {MAX_INPUTS} pairs per request", names[1])
    if len(first) == 1:
        first = first * len(second)
    return list(zip(first, second, strict=True))


def _check_serves_scores(ctx: ServerContext, api: str) -> None:
    """A 400 unless the engine serves a one-label cross-encoder or an embedding model, saying what
    it serves instead."""
    spec = embed_spec_of(ctx.engine, ctx.model_name)
    num_labels = spec.num_labels
    if spec.is_token_classifier:
        raise errors.invalid_request(
            f"The model {ctx.model_name} does not support the {api} API: it is {spec.describe()}; "
            f"use {spec.routes()}.",
            "model",
        )
    if num_labels == 1 or (num_labels == 0 and runner_of(ctx.engine) == "pooling"):
        return
    if num_labels > 1:
        what = f"a classification model with {num_labels} labels (scores need one; /classify labels)"
    else:
        what = "a text generation model (--runner generate)"
    raise errors.invalid_request(
        f"The model {ctx.model_name} does not support the {api} API: it is {what}. Serve a "
        "cross-encoder (*ForSequenceClassification, one label) or an embedding model for scores.",
        "model",
    )


async def _encode_pairs(
    ctx: ServerContext,
    pairs: list[tuple[str, str]],
    keep: int | None,
    params: list[str],
    activation: ClassifierActivation,
) -> tuple[list[list[int]], list[PoolingParams]]:
    """Each pair's token ids (the tokenizer's pair encoding) and its PoolingParams; a pair longer
    than the context (after truncate_prompt_tokens) is a 400 naming `params[i]`."""
    max_len = ctx.engine.max_model_len
    keep = max_len if keep == -1 else keep
    if keep is None:
        for (a, b), param in zip(pairs, params, strict=True):
            ctx.check_chars_fit(len(a) + len(b), "pair", param)
    tokenizer = ctx.engine.tokenizer
    truncation: dict[str, Any] = {} if keep is None else {"truncation": True, "max_length": keep}

    def encode() -> tuple[list[list[int]], list[PoolingParams]]:
        prompts, pooling = [], []
        for (a, b), param in zip(pairs, params, strict=True):
            encoded = tokenizer(a, b, **truncation)
            ids = list(encoded["input_ids"])
            if len(ids) > max_len:
                raise too_long(max_len, "pair", len(ids), param)
            prompts.append(ids)
            start = _second_segment(encoded, len(ids))
            pooling.append(PoolingParams(task="classify", second_segment_start=start, activation=activation))
        return prompts, pooling

    return await ctx.off_loop(encode, sum(len(a) + len(b) for a, b in pairs))


def _second_segment(encoded: Any, num_tokens: int) -> int | None:
    """Where token type 1 starts (None: all 0, as XLM-RoBERTa's tokenizer gives); the types of a
    pair encoding are 0s then 1s, so this one position says them all."""
    types = encoded.get("token_type_ids")
    if not types or 1 not in types:
        return None
    start = list(types).index(1)
    if list(types) != [0] * start + [1] * (num_tokens - start):
        raise errors.APIError(500, "the tokenizer's token types are not one run of 0s then 1s")
    return start


async def _run_pairs(
    ctx: ServerContext,
    request: Request,
    req: _PairRequest,
    request_id: str,
    pairs: list[tuple[str, str]],
    params: list[str],
) -> tuple[list[float], int] | None:
    """The pairs' scores in order and the tokens run, or None where the client left first."""
    keep = req.truncate_prompt_tokens
    if num_labels_of(ctx.engine) == 0:  # an embedding model
        return await _cosine_scores(ctx, request, request_id, pairs, keep, params)
    prompts, pooling = await _encode_pairs(ctx, pairs, keep, params, req.activation_kind())
    run = GenerationRun(ctx.engine, ctx.metrics, ctx.in_flight, request_id, prompts, pooling)
    finals = await pooled_finals(run, request, "score")
    if finals is None:
        return None
    return [out.embedding[0] for out in finals], _num_tokens(finals)  # type: ignore[index]


async def _cosine_scores(
    ctx: ServerContext,
    request: Request,
    request_id: str,
    pairs: list[tuple[str, str]],
    keep: int | None,
    params: list[str],
) -> tuple[list[float], int] | None:
    """vLLM's score for an embedding model: each distinct text embedded once (normalized, whatever
    the model's default), a pair's score the dot product of its two unit vectors."""
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    param_of = {text: param for pair, param in zip(pairs, params, strict=True) for text in pair}
    # The last k tokens of each, as /v1/embeddings keeps them.
    prompts = await tokenize_inputs(ctx, list(texts), [param_of[t] for t in texts], keep, "text")
    unit = PoolingParams(normalize=True)
    run = GenerationRun(ctx.engine, ctx.metrics, ctx.in_flight, request_id, prompts, unit)
    finals = await pooled_finals(run, request, "score")
    if finals is None:
        return None
    vectors = {text: out.embedding or [] for text, out in zip(texts, finals, strict=True)}
    scores = [sum(x * y for x, y in zip(vectors[a], vectors[b], strict=True)) for a, b in pairs]
    return scores, _num_tokens(finals)


def _num_tokens(finals: list[RequestOutput]) -> int:
    return sum(len(out.prompt_token_ids) for out in finals)


async def create_score(ctx: ServerContext, request: Request) -> Response:
    req = await ctx.parse(request, ScoreRequest)
    _check_serves_scores(ctx, "Score")
    pairs = _pairs(req.text_1, req.text_2, ("text_1", "text_2"))
    names = ["text_2" if isinstance(req.text_2, str) else f"text_2.{i}" for i in range(len(pairs))]
    request_id = new_id("score")
    scored = await _run_pairs(ctx, request, req, request_id, pairs, names)
    if scored is None:
        return Response(status_code=499)
    scores, num_tokens = scored
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": now_s(),
            "model": req.model,
            "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )


async def create_rerank(ctx: ServerContext, request: Request) -> Response:
    req = await ctx.parse(request, RerankRequest)
    _check_serves_scores(ctx, "Rerank")
    pairs = _pairs(req.query, req.documents, ("query", "documents"))
    names = [f"documents.{i}" for i in range(len(pairs))]
    request_id = new_id("rerank")
    scored = await _run_pairs(ctx, request, req, request_id, pairs, names)
    if scored is None:
        return Response(status_code=499)
    scores, num_tokens = scored
    results: list[dict[str, Any]] = []
    for i, score in enumerate(scores):
        result: dict[str, Any] = {"index": i}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        result["relevance_score"] = score
        results.append(result)
    results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: ties keep their order
    top_n = req.top_n if req.top_n > 0 else len(results)
    return JSONResponse(
        {
            "id": request_id,
            "model": req.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": results[:top_n],
        }
    )
