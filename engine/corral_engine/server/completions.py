"""POST /v1/completions: prompts (text or token ids) in, text completions out, streamed or not."""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral_engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from corral_engine.server import errors
from corral_engine.server.api_models import CompletionRequest
from corral_engine.server.context import (
    RunningUsage,
    ServerContext,
    new_id,
    now_s,
    remaining_context,
    usage,
)
from corral_engine.server.generation import Collected, GenerationRun, collect_unless_disconnected
from corral_engine.server.logprobs import (
    TextRooms,
    TokenText,
    completion_logprobs,
    offsets_of,
    prompt_logprobs_json,
    unscored,
)
from corral_engine.server.streaming import ChunkEncoder, EngineStreamingResponse
from corral_engine.tokenizer import decode

logger = logging.getLogger(__name__)


async def tokenize_prompts(
    ctx: ServerContext, req: CompletionRequest, check_fits: bool = True
) -> list[list[int]]:
    """Token ids of each prompt, as the engine will see them. A text prompt that cannot fit the
    context is refused untokenized (`check_fits`, unless it is to be truncated); long ones are
    tokenized off the event loop."""
    given = req.prompts()
    texts = [p for p in given if isinstance(p, str)]
    if check_fits and req.truncate_prompt_tokens is None:
        for i, prompt in enumerate(given):
            if isinstance(prompt, str):
                ctx.check_fits(prompt, "prompt" if i == 0 else f"prompt.{i}")

    def tokenize() -> list[list[int]]:
        prompts: list[list[int]] = []
        for i, prompt in enumerate(given):
            if isinstance(prompt, list):
                ids = prompt
            elif req.add_special_tokens:
                ids = ctx.encode(prompt)
            else:
                ids = list(ctx.engine.tokenizer.encode(prompt, add_special_tokens=False))
            if not ids:
                raise errors.invalid_request(
                    "The prompt must not be empty.", "prompt" if i == 0 else f"prompt.{i}"
                )
            prompts.append(req.truncate(ids))
        return prompts

    return await ctx.off_loop(tokenize, sum(map(len, texts)))


def _is_echo_decoded(req: CompletionRequest, prompt: str | list[int]) -> bool:
    """Whether `echo` writes the prompt decoded from its tokens, rather than as given."""
    return not isinstance(prompt, str) or req.truncate_prompt_tokens is not None


def _echo_texts(ctx: ServerContext, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What `echo` puts before each prompt's completions: the prompt as given (text prompts, unless
    truncated) or decoded with the request's special-token settings, as the completions' text is."""
    if not req.echo:
        return [""] * len(prompts)
    tokenizer, skip, spaced = ctx.engine.tokenizer, req.skip_special_tokens, req.spaces_between_special_tokens
    return [
        decode(tokenizer, ids, skip, spaced) if _is_echo_decoded(req, p) else str(p)
        for p, ids in zip(req.prompts(), prompts, strict=True)
    ]


def _best(
    collected: Collected, prompt_index: int, outputs: list[CompletionOutput], n: int
) -> list[CompletionOutput]:
    """best_of: the n outputs with the highest cumulative logprob, likeliest first."""

    def total(o: CompletionOutput) -> float:
        return sum(lp.logprob for lp in collected.logprobs_of(prompt_index, o.index))

    return sorted(outputs, key=total, reverse=True)[:n]


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    req = await ctx.parse(request, CompletionRequest)
    prompts = await tokenize_prompts(ctx, req)
    max_tokens = req.max_tokens if req.max_tokens is not None else remaining_context(ctx, prompts, "prompt")
    prompt_k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:  # the prompt's tokens come with logprobs too
        prompt_k = max(prompt_k or 0, req.logprobs)
    if prompt_k is not None and req.stream:
        raise errors.invalid_request(
            "Prompt logprobs (prompt_logprobs, echo with logprobs) are not streamed.", "stream"
        )
    best_of = req.best_of or req.n
    # best_of ranks sequences by their cumulative logprob: the chosen tokens' logprobs are needed.
    logprobs = req.logprobs if req.logprobs is not None or best_of == req.n else 0
    params = req.to_sampling_params(max_tokens, logprobs).replace(n=best_of, prompt_logprobs=prompt_k)
    echo = _echo_texts(ctx, req, prompts)
    request_id = new_id("cmpl")
    run = ctx.start_run(request_id, prompts, params, req.model)
    # DEBUG, as vLLM logs arrivals only when asked: the access line at the end is the INFO one.
    logger.debug("request %s: %d prompt(s), n=%d, stream=%s", request_id, len(prompts), req.n, req.stream)
    created = now_s()
    if req.stream:
        return EngineStreamingResponse(run, _CompletionChunks(ctx, req, run, created, echo))
    collected = await collect_unless_disconnected(run, request.receive)
    if collected is None:
        return Response(status_code=499)
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": req.model,  # the base model or the adapter asked for
            "choices": [
                _final_choice(ctx, req, i * req.n + j, out, o, echo[i], collected.logprobs_of(i, o.index))
                for i, out in enumerate(collected.finals)
                for j, o in enumerate(
                    _best(collected, i, out.outputs, req.n) if best_of > req.n else out.outputs
                )
            ],
            "usage": usage(collected.finals),
        }
    )


def _final_choice(
    ctx: ServerContext,
    req: CompletionRequest,
    index: int,
    out: RequestOutput,
    o: CompletionOutput,
    echo: str,
    items: list[TokenLogprob],
) -> dict[str, Any]:
    """A finished choice: with echo the prompt's text (and its tokens' logprobs) come first."""
    prompt = out.prompt_logprobs
    offsets: list[int] = []
    if req.logprobs is not None:
        tokenizer, spaced = ctx.engine.tokenizer, req.spaces_between_special_tokens
        rooms = TextRooms(tokenizer, out.prompt_token_ids, req.skip_special_tokens, spaced).add(
            (lp.token_id for lp in items), True
        )
        offsets = offsets_of(rooms, len(echo))
        if echo and prompt is not None:
            scored = [unscored(out.prompt_token_ids[0]), *(lp for lp in prompt[1:] if lp is not None)]
            # A prompt echoed as given holds no special token its tokens have (BOS).
            skip = req.skip_special_tokens or not _is_echo_decoded(req, req.prompts()[index // req.n])
            echoed = TextRooms(tokenizer, [], skip, spaced).add((lp.token_id for lp in scored), True)
            items, offsets = [*scored, *items], offsets_of(echoed, 0) + offsets
    choice = _choice(req, index, o, echo + o.text, items, ctx.token_text, offsets)
    if req.prompt_logprobs is not None and prompt is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(prompt, ctx.token_text)
    return choice


def _choice(
    req: CompletionRequest,
    index: int,
    o: CompletionOutput,
    text: str,
    logprob_items: Any,
    token_text: TokenText,
    offsets: list[int],
) -> dict[str, Any]:
    logprobs = None
    if req.logprobs is not None and logprob_items is not None:
        logprobs = completion_logprobs(logprob_items, req.logprobs, token_text, offsets)
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": o.finish_reason,
        "stop_reason": o.stop_reason,
    }


class _CompletionChunks:
    """A streamed completion's chunks: each choice's new text (after echo's prompt, on its first
    chunk), its finish reason once, and the totals at the end where asked."""

    def __init__(
        self, ctx: ServerContext, req: CompletionRequest, run: GenerationRun, created: int, echo: list[str]
    ) -> None:
        base = {"id": run.request_id, "object": "text_completion", "created": created}
        base["model"] = req.model  # the base model or the adapter asked for
        self.ctx, self.req, self.echo = ctx, req, echo
        # With include_usage every chunk carries "usage": null, and a last one the totals.
        self.encoder = ChunkEncoder(base, req.include_usage_in_stream)
        self.running = RunningUsage(run.num_prompt_tokens) if req.running_usage_in_stream else None
        self.finals: dict[int, RequestOutput] = {}
        self.sent_finish: set[int] = set()
        self.offsets: dict[int, int] = {}  # per choice: the text sent so far
        self.rooms: dict[int, TextRooms] = {}  # per choice: where its tokens fall in its text
        self.token_ends: dict[int, int] = {}  # per choice: the offset after its last token

    def feed(self, prompt_index: int, out: RequestOutput) -> list[bytes]:
        req, offsets, events = self.req, self.offsets, []
        for o in out.outputs:
            index = prompt_index * req.n + o.index
            if index in self.sent_finish or not (o.delta_text or o.delta_token_ids or o.finish_reason):
                continue
            if o.finish_reason is not None:
                self.sent_finish.add(index)
            text = o.delta_text if index in offsets else self.echo[prompt_index] + o.delta_text
            token_offsets = self._token_offsets(index, out, o, len(self.echo[prompt_index]))
            choice = _choice(req, index, o, text, o.delta_logprobs, self.ctx.token_text, token_offsets)
            offsets[index] = offsets.get(index, 0) + len(text)
            if self.running is None:
                events.append(self.encoder.chunk([choice]))
            else:
                events.append(self.encoder.chunk([choice], usage=self.running.add(len(o.delta_token_ids))))
        if out.finished:
            self.finals[prompt_index] = out
        return events

    def _token_offsets(self, index: int, out: RequestOutput, o: CompletionOutput, start: int) -> list[int]:
        """The offsets of this chunk's tokens in the choice's whole text (with logprobs)."""
        if self.req.logprobs is None or o.delta_logprobs is None:
            return []
        if index not in self.rooms:
            req, tokenizer = self.req, self.ctx.engine.tokenizer
            spaced = req.spaces_between_special_tokens
            self.rooms[index] = TextRooms(tokenizer, out.prompt_token_ids, req.skip_special_tokens, spaced)
        ids = (lp.token_id for lp in o.delta_logprobs)
        rooms = self.rooms[index].add(ids, o.finish_reason is not None)
        start = self.token_ends.get(index, start)
        self.token_ends[index] = start + sum(rooms)
        return offsets_of(rooms, start)

    def end(self) -> list[bytes]:
        if not self.req.include_usage_in_stream:
            return []
        return [self.encoder.chunk([], usage=usage(list(self.finals.values())))]
