"""POST /v1/chat/completions: messages through the model's chat template, replies streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.chat_template import NO_TEMPLATE_MESSAGE, has_chat_template
from corral_engine.errors import InvalidRequestError
from corral_engine.multimodal import ImageInput, ImagePrompts, check_num_images
from corral_engine.outputs import RequestOutput
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import errors
from corral_engine.server.api_chat import ChatCompletionRequest
from corral_engine.server.api_tools import ToolPlan, plan_tools
from corral_engine.server.context import (
    OFF_LOOP_CHARS,
    RunningUsage,
    ServerContext,
    new_id,
    now_s,
    remaining_context,
    usage,
)
from corral_engine.server.generation import GenerationRun, collect_unless_disconnected
from corral_engine.server.image_urls import ImageRef, load_images
from corral_engine.server.logprobs import chat_logprobs, prompt_logprobs_json
from corral_engine.server.reasoning import (
    NUM_PROMPT_TAIL_TOKENS,
    REASONING_FIELDS,
    ReasoningCount,
    ReasoningPlan,
    num_reasoning_tokens,
    plan_reasoning,
)
from corral_engine.server.streaming import ChunkEncoder, EngineStreamingResponse
from corral_engine.server.tool_calls import ReplyStream, finish_reason, reply_message

logger = logging.getLogger(__name__)


def _template_errors() -> tuple[type[Exception], ...]:
    kinds: list[type[Exception]] = [ValueError, TypeError, KeyError, IndexError]
    try:
        from jinja2 import TemplateError

        kinds.append(TemplateError)
    except ImportError:  # tokenizers without jinja2 cannot render templates at all
        pass
    return tuple(kinds)


async def render_prompt(ctx: ServerContext, req: ChatCompletionRequest, check_fits: bool = True) -> list[int]:
    """Token ids of the conversation rendered by the chat template (--chat-template's, else the
    model's), ready for a reply. Messages that cannot fit the context are refused unrendered, a
    rendering untokenized (`check_fits`, unless it is to be truncated); a long conversation is
    rendered and tokenized off the event loop."""
    if ctx.chat_template is None and not has_chat_template(ctx.engine.tokenizer):
        raise errors.invalid_request(NO_TEMPLATE_MESSAGE, "messages")
    # --chat-template's goes to the renderer only where given: the tokenizer's own is the default.
    template = {} if ctx.chat_template is None else {"chat_template": ctx.chat_template}
    is_checked = check_fits and req.truncate_prompt_tokens is None

    def render() -> list[int]:
        if is_checked:  # before rendering: 300k short messages took seconds to render, then a 400
            ctx.check_chars_fit(req.num_rendered_chars(), "user turns' text", "messages")
        try:
            text = ctx.engine.tokenizer.apply_chat_template(
                req.template_messages(), tokenize=False, **template, **req.template_kwargs()
            )
        except _template_errors() as e:
            raise errors.invalid_request(f"The chat template rejected the messages: {e}", "messages") from e
        if is_checked:
            ctx.check_fits(str(text), "messages")
        # The template already holds any special tokens (BOS); don't add them twice unless asked.
        ids = req.truncate(
            list(ctx.engine.tokenizer.encode(str(text), add_special_tokens=req.add_special_tokens))
        )
        if not ids:
            raise errors.invalid_request("The messages render to an empty prompt.", "messages")
        return ids

    return await ctx.off_loop(render, req.num_chars(at_most=OFF_LOOP_CHARS))


async def chat_prompt(
    ctx: ServerContext, req: ChatCompletionRequest, check_fits: bool = True
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The rendered prompt and its images: each image part's URL read (decoded, or fetched), its
    `<image>` expanded to the image's placeholder tokens by the engine's image processor
    (`check_fits`: as render_prompt's)."""
    parts = req.image_parts()
    images: ImagePrompts | None = getattr(ctx.engine, "images", None)
    if parts and images is None:
        raise errors.invalid_request(
            f"{ctx.engine.served_model_name} is a text-only model, not a vision-language one: "
            "it takes no image_url parts.",
            parts[0][1],
        )
    if images is not None and len(parts) > images.max_images:  # before anything is fetched
        check_num_images(len(parts), images.max_images, parts[images.max_images][1])  # the first past it
    prompt = await render_prompt(ctx, req, check_fits)
    if images is None or not parts:
        return prompt, ()
    pil_images = await load_images([ImageRef(url, param) for url, param in parts], images.allowed_hosts)
    try:
        return await asyncio.to_thread(images.build, prompt, pil_images)
    except InvalidRequestError as e:  # the template placed fewer or more images than the parts
        raise errors.invalid_request(str(e), "messages") from None


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    req = await ctx.parse(request, ChatCompletionRequest)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_call_parser)
    prompt, mm_inputs = await chat_prompt(ctx, req)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = remaining_context(ctx, [prompt], "messages")
    if req.prompt_logprobs is not None and req.stream:
        raise errors.invalid_request("prompt_logprobs are not streamed.", "stream")
    reasoning = reasoning_plan(ctx, req, prompt)
    params = reply_params(req, max_tokens, plan, reasoning)
    request_id = new_id("chatcmpl")
    run = ctx.start_run(request_id, [prompt], params, req.model, mm_inputs)
    logger.debug("request %s: chat, n=%d, stream=%s", request_id, req.n, req.stream)  # INFO: the access line
    created = now_s()
    if req.stream:
        return EngineStreamingResponse(run, _ChatChunks(ctx, req, plan, reasoning, run, created))
    collected = await collect_unless_disconnected(run, request.receive)
    if collected is None:
        return Response(status_code=499)
    choices = []
    for out in collected.finals:
        for o in out.outputs:
            logprobs = None
            if req.num_logprobs is not None:
                logprobs = chat_logprobs(collected.logprobs_of(0, o.index), req.num_logprobs, ctx.token_text)
            message = reply_message(plan, o.text, reasoning)
            if ctx.reasoning_parser is not None and req.is_reasoning_shown:  # thinking off: null, as vLLM
                message.update({k: message.get(k) for k in REASONING_FIELDS})
            choices.append(
                {
                    "index": o.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(o.finish_reason, "tool_calls" in message),
                    "stop_reason": o.stop_reason,
                }
            )
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": req.model,  # the base model or the adapter asked for
        "choices": choices,
        "usage": usage(collected.finals, reasoning_tokens(ctx, reasoning, collected.finals)),
    }
    scored = collected.finals[0].prompt_logprobs if collected.finals else None
    if req.prompt_logprobs is not None and scored is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(scored, ctx.token_text)
    return JSONResponse(body)


def reasoning_plan(ctx: ServerContext, req: ChatCompletionRequest, prompt: list[int]) -> ReasoningPlan | None:
    """How the replies' reasoning is read (--reasoning-parser), from where the prompt leaves them."""
    if ctx.reasoning_parser is None:
        if not req.is_reasoning_shown:
            raise errors.invalid_request(
                "include_reasoning needs the server to be started with --reasoning-parser",
                "include_reasoning",
            )
        return None
    tail = ctx.engine.tokenizer.decode(prompt[-NUM_PROMPT_TAIL_TOKENS:])
    # A continued final message may have opened its block further back than the tail reaches.
    continued = req.messages[-1].text() if req.continue_final_message else ""
    return plan_reasoning(ctx.reasoning_parser, tail, req.is_reasoning_shown, continued)


def reasoning_tokens(ctx: ServerContext, plan: ReasoningPlan | None, finals: list[RequestOutput]) -> int:
    """Tokens the replies wrote in their reasoning blocks (0 without a parser or a block)."""
    if plan is None:
        return 0
    texts = ctx.shown_text
    return sum(num_reasoning_tokens(plan, o.text, o.token_ids, texts) for out in finals for o in out.outputs)


def reply_params(
    req: ChatCompletionRequest, max_tokens: int, plan: ToolPlan, reasoning: ReasoningPlan | None
) -> SamplingParams:
    """The request's sampling; its grammar (tools, response_format) holds after the reasoning block,
    and its text shows the special tokens its parsers read, tool markers and reasoning tags (as
    vLLM's mistral parser turns skip_special_tokens off; every other special token is left out)."""
    params = req.to_sampling_params(max_tokens, req.num_logprobs, plan.grammar)
    tags = () if reasoning is None else (reasoning.format.start, reasoning.format.end)
    if plan.markers or tags:
        params = params.replace(shown_special_tokens=(*plan.markers, *tags))
    if reasoning is not None and params.grammar is not None:
        params = dataclasses.replace(params, grammar=reasoning.constrain(params.grammar))
    return params


class _ChatChunks:
    """A streamed chat reply's chunks: the role with the first tokens, each choice's content (or
    tool-call deltas, as the reply's parser reads them), its finish reason once, and the totals at
    the end where asked."""

    def __init__(
        self,
        ctx: ServerContext,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        reasoning: ReasoningPlan | None,
        run: GenerationRun,
        created: int,
    ) -> None:
        base = {
            "id": run.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,  # the base model or the adapter asked for
        }
        self.ctx, self.req, self.reasoning = ctx, req, reasoning
        # With include_usage every chunk carries "usage": null, and a last one the totals.
        self.encoder = ChunkEncoder(base, req.include_usage_in_stream)
        self.running = RunningUsage(run.num_prompt_tokens) if req.running_usage_in_stream else None
        self.final: RequestOutput | None = None
        self.sent_finish: set[int] = set()
        self.pending: dict[int, int] = {}  # tokens not yet sent in a chunk (no text yet), per choice
        self.replies = [ReplyStream(plan, reasoning) for _ in range(req.n)]
        # With continuous usage: each choice's tokens sent, and how many of them are reasoning.
        self.num_sent = [0] * req.n
        self.thoughts = [ReasoningCount(reasoning, ctx.shown_text) for _ in range(req.n)] if reasoning else []
        self.is_first = True

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: Any = None,
        num_tokens: int = 0,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if self.running is None:
            return self.encoder.chunk([choice])
        self.num_sent[index] += num_tokens
        # As the final usage: the reasoning tokens of those sent so far (0 without a parser).
        num_reasoning = sum(t.of_first(n) for t, n in zip(self.thoughts, self.num_sent, strict=False))
        details = {"reasoning_tokens": num_reasoning}
        return self.encoder.chunk(
            [choice], usage={**self.running.add(num_tokens), "completion_tokens_details": details}
        )

    def feed(self, prompt_index: int, out: RequestOutput) -> list[bytes]:
        req, pending, events = self.req, self.pending, []
        if self.is_first:  # the role goes with the first tokens, not before the prompt is computed:
            self.is_first = False  # the gateway takes a response's first bytes for that moment
            for index in range(req.n):
                events.append(self._chunk(index, {"role": "assistant", "content": ""}))
        for o in out.outputs:
            if o.index in self.sent_finish:
                continue
            pending[o.index] = pending.get(o.index, 0) + len(o.delta_token_ids)
            if self.running is not None and self.thoughts:
                self.thoughts[o.index].feed(o.delta_text, o.delta_token_ids, o.finish_reason is not None)
            reply = self.replies[o.index]
            deltas = reply.feed(o.delta_text, o.finish_reason is not None)
            if not deltas and o.delta_logprobs:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                # A step's logprobs and token count ride on its first chunk.
                logprobs = None
                if i == 0 and req.num_logprobs is not None:
                    logprobs = chat_logprobs(o.delta_logprobs or [], req.num_logprobs, self.ctx.token_text)
                num_tokens = pending.pop(o.index, 0) if i == 0 else 0
                events.append(self._chunk(o.index, delta, logprobs=logprobs, num_tokens=num_tokens))
            if o.finish_reason is not None:
                self.sent_finish.add(o.index)
                finish = finish_reason(o.finish_reason, reply.has_calls)
                events.append(self._chunk(o.index, {}, finish=finish, num_tokens=pending.pop(o.index, 0)))
        if out.finished:
            self.final = out
        return events

    def end(self) -> list[bytes]:
        if not self.req.include_usage_in_stream:
            return []
        finals = [self.final] if self.final else []
        num_reasoning = reasoning_tokens(self.ctx, self.reasoning, finals)
        return [self.encoder.chunk([], usage=usage(finals, num_reasoning))]
