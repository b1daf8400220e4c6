"""POST /v1/responses: OpenAI's Responses API served on the chat path (the same chat template,
sampling, tool parsing, limits and metrics), streamed or not. Nothing is stored: GET and DELETE of
a response id are 404s saying so."""

from __future__ import annotations

import functools
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.errors import InvalidRequestError
from corral_engine.server import errors
from corral_engine.server.api_chat import ChatCompletionRequest
from corral_engine.server.api_responses import ResponsesRequest
from corral_engine.server.api_tools import plan_tools
from corral_engine.server.chat import chat_prompt, reasoning_plan, reasoning_tokens, reply_params
from corral_engine.server.context import ServerContext, new_id, now_s, remaining_context
from corral_engine.server.generation import collect_unless_disconnected
from corral_engine.server.responses_output import ResponseShell, output_items, status_of
from corral_engine.server.responses_stream import ResponseEvents, ResponseStreamingResponse

logger = logging.getLogger(__name__)

# The chat path names chat's fields in its errors; a Responses client sent these instead.
_PARAMS = {  # the longer first: the first whose prefix matches is taken
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "messages": "input",
    "max_tokens": "max_output_tokens",
}


async def create_response(ctx: ServerContext, request: Request) -> Response:
    req, chat = await ctx.parse_into(request, ResponsesRequest, _with_chat)
    try:
        return await _respond(ctx, req, chat, request)
    except (errors.APIError, InvalidRequestError) as e:
        raise _renamed(e) from e


def _with_chat(req: ResponsesRequest) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """The request and the chat request it asks for, its errors named as the Responses API does."""
    try:
        return req, req.chat_request()
    except (errors.APIError, InvalidRequestError) as e:
        raise _renamed(e) from e


async def _respond(
    ctx: ServerContext, req: ResponsesRequest, chat: ChatCompletionRequest, request: Request
) -> Response:
    prompt, mm_inputs = await chat_prompt(ctx, chat)
    max_tokens = chat.requested_max_tokens
    if max_tokens is None:
        max_tokens = remaining_context(ctx, [prompt], "input")
    plan = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls, ctx.tool_call_parser)
    reasoning = reasoning_plan(ctx, chat, prompt)  # a reasoning block is a reasoning item
    params = reply_params(chat, max_tokens, plan, reasoning)
    response_id = new_id("resp").replace("-", "_", 1)  # OpenAI's `resp_` ids
    shell = ResponseShell(req, response_id, chat.model, now_s())  # the base model or the adapter
    run = ctx.start_run(response_id, [prompt], params, chat.model, mm_inputs)
    logger.debug("request %s: responses, stream=%s", response_id, req.stream)  # INFO: the access line
    if req.stream:
        count = functools.partial(reasoning_tokens, ctx, reasoning)
        return ResponseStreamingResponse(run, ResponseEvents(shell, plan, reasoning, count))
    collected = await collect_unless_disconnected(run, request.receive)
    if collected is None:
        return Response(status_code=499)
    final = collected.finals[0] if collected.finals else None
    reason = final.outputs[0].finish_reason if final is not None else None
    text = final.outputs[0].text if final is not None else ""
    output = output_items(plan, text, reason, reasoning)
    return JSONResponse(
        shell.body(status_of(reason), output, final, reasoning_tokens(ctx, reasoning, collected.finals))
    )


def _renamed(e: errors.APIError | InvalidRequestError) -> errors.APIError | InvalidRequestError:
    """The error with its param named as the Responses API names it."""
    param = e.param or ""
    if param.startswith("messages["):  # an image part: chat's message index is not the item's
        param = "messages"
    for old, new in _PARAMS.items():
        if param == old or param.startswith(old + "."):
            renamed = new + param[len(old) :]
            break
    else:
        return e
    if isinstance(e, InvalidRequestError):
        return InvalidRequestError(str(e), renamed)
    e.param = renamed
    return e


async def stored_response(request: Request) -> Response:
    """GET or DELETE /v1/responses/{id}: nothing is stored to find."""
    response_id = request.path_params.get("response_id", "")
    message = (
        f"No response `{response_id}`: this server does not store responses, so they cannot be "
        "retrieved, listed, cancelled or deleted."
    )
    return errors.error_response(errors.APIError(404, message, param="response_id", code="not_found"))
