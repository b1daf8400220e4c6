"""vLLM's /tokenize and /detokenize: a prompt or a conversation to token ids as the
generation endpoints would build them, and token ids back to text (/version is in app.py)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from corral_engine.server import errors
from corral_engine.server.api_chat import ChatCompletionRequest
from corral_engine.server.api_models import CompletionRequest, TokenId, _Strict
from corral_engine.server.chat import chat_prompt
from corral_engine.server.completions import tokenize_prompts
from corral_engine.server.context import ServerContext, read_body


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


async def _body(ctx: ServerContext, request: Request) -> dict[str, Any]:
    if ctx.is_draining:
        raise errors.draining()
    raw = await read_body(request)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.invalid_request(f"We could not parse the JSON body of your request: {e}") from e
    if not isinstance(body, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    model = body.setdefault("model", ctx.model_name)  # optional here, as in vLLM
    if model != ctx.model_name:
        raise errors.model_not_found(str(model))
    return body


async def tokenize(ctx: ServerContext, request: Request) -> JSONResponse:
    """{"prompt"} or {"messages", ...chat fields}; with return_token_strs, each token's text too.
    A conversation's images count as the generation routes count them (vLLM counts only the text)."""
    body = await _body(ctx, request)
    want_strs = body.pop("return_token_strs", False) is True
    if "messages" in body:  # a vision model's images expanded to their placeholder tokens, as served
        chat = ChatCompletionRequest.model_validate(body)
        tokens, _ = await chat_prompt(ctx, chat, check_fits=False)
    else:
        prompts = await tokenize_prompts(
            ctx, CompletionRequest.model_validate({"max_tokens": 1, **body}), check_fits=False
        )
        if len(prompts) != 1:
            raise errors.invalid_request("/tokenize takes one prompt.", "prompt")
        tokens = prompts[0]
    strs = [ctx.token_text(t) for t in tokens] if want_strs else None
    return JSONResponse(
        {
            "count": len(tokens),
            "max_model_len": ctx.engine.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
    )


async def detokenize(ctx: ServerContext, request: Request) -> JSONResponse:
    req = DetokenizeRequest.model_validate(await _body(ctx, request))
    size = ctx.num_token_ids
    if size is not None and any(t >= size for t in req.tokens):  # decode would drop them silently
        raise errors.invalid_request(f"token ids must be in [0, {size})", "tokens")
    return JSONResponse({"prompt": str(ctx.engine.tokenizer.decode(req.tokens))})
