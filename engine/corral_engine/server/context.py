"""What the request handlers share: the engine, metrics, lifecycle flags, and body parsing."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from corral_engine import wire
from corral_engine.lora import AdapterRegistry
from corral_engine.multimodal import ImageInput
from corral_engine.outputs import RequestOutput
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import access, errors
from corral_engine.server.engine_client import EngineClient
from corral_engine.server.generation import GenerationRun, InFlight
from corral_engine.server.metrics import ServerMetrics
from corral_engine.server.reasoning import REASONING_PARSERS
from corral_engine.tokenizer import encoder, special_tokens, vocabulary

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = wire.MAX_REQUEST_BODY_BYTES
# A prompt of more characters is tokenized (a conversation rendered) on the tokenizer's thread:
# ~1.5 µs a character on the demo tokenizer, so a 200 KB prompt would hold the event loop (every
# stream, /health) for ~0.3 s; below this the thread hop (~0.1 ms) costs more than it saves.
OFF_LOOP_CHARS = 4096
# A body of more bytes is parsed and validated on its own thread. Validation costs up to ~15 µs a
# message or content part (the validators are Python), so a 32 MiB body of a million tiny messages
# held the event loop (every stream, /health) for 5-10 s; a 16 KiB one costs well under 10 ms.
OFF_LOOP_BODY_BYTES = 16 * 1024
# Unicode normalization may shorten a text before it is split (composing marks: at most 3 code
# points into 1); the length bound below allows for that and some.
_NORMALIZED_SHRINK = 4
ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


async def read_body(request: Request) -> bytes:
    """The request's body, refused with 413 as soon as it passes MAX_BODY_BYTES: by its declared
    length before any of it is read, else while it arrives (a 400 MB body used to be held whole,
    and the engine's memory grew by as much, before its 413)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> errors.APIError:
    return errors.APIError(
        413, f"The request body is larger than {MAX_BODY_BYTES} bytes.", code=wire.CODE_REQUEST_TOO_LARGE
    )


@dataclass
class ServerContext:
    engine: EngineClient
    metrics: ServerMetrics
    api_key: str | None = None
    tool_call_parser: str | None = None  # --tool-call-parser: enables tool_choice "auto"
    chat_template: str | None = None  # --chat-template, read: rendered in place of the tokenizer's
    reasoning_parser: str | None = None  # --reasoning-parser: chat replies' reasoning_content
    log_probe_requests: bool = False  # --log-probe-requests: access lines for successful probes too
    adapters: AdapterRegistry = field(default_factory=AdapterRegistry)  # served LoRA adapters
    is_lora_enabled: bool = False  # --enable-lora: responses carry the adapters' version
    in_flight: InFlight = field(default_factory=InFlight)
    is_ready: bool = False
    is_draining: bool = False

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    async def parse(self, request: Request, model: type[ModelT]) -> ModelT:
        """Read and validate a JSON body; every failure is a 4xx (APIError, InvalidRequestError)."""
        return await self.parse_into(request, model, _itself)

    async def parse_into(self, request: Request, model: type[ModelT], convert: Callable[[ModelT], T]) -> T:
        """convert(the validated body): where a request is validated again as another (a
        Responses request as chat's), that costs what the first validation did, and runs with it."""
        if self.is_draining:
            raise errors.draining()
        body = await read_body(request)
        validate = functools.partial(_validated, model, body, self.serves, convert)
        if len(body) < OFF_LOOP_BODY_BYTES:
            return validate()
        # In this request's context: what check_fields logs names the request.
        in_context = functools.partial(contextvars.copy_context().run, validate)
        return await asyncio.get_running_loop().run_in_executor(self._body_thread, in_context)

    @functools.cached_property
    def _body_thread(self) -> ThreadPoolExecutor:
        # Its own thread, not the tokenizer's: a large body waits behind large bodies only, and
        # long prompts are tokenized meanwhile.
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-parse")

    def serves(self, model: object) -> bool:
        """Whether `model` names the base model or one of the adapters served."""
        return model == self.model_name or model in self.adapters

    def start_run(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        model: str | None = None,
        mm_inputs: tuple[ImageInput, ...] = (),
    ) -> GenerationRun:
        """The request's engine requests; `model`: the name it asked for (an adapter's runs it);
        `mm_inputs`: a single prompt's images."""
        access.note_generation(request_id, params)
        lora = None
        if model is not None and model != self.model_name:
            lora = self.adapters.get(model)
            if lora is None:  # unloaded since its body was checked: never the base model instead
                raise errors.model_not_found(model)
        return GenerationRun(
            self.engine, self.metrics, self.in_flight, request_id, prompts, params, lora, mm_inputs
        )

    @functools.cached_property
    def encode(self) -> Callable[[str], list[int]]:
        """text -> token ids, as the tokenizer's own `encode` gives them (`tokenizer.encoder`)."""
        return encoder(self.engine.tokenizer)

    @functools.cached_property
    def _tokenizer_thread(self) -> ThreadPoolExecutor:
        # One thread: long prompts queue behind each other rather than take both cores from the
        # steps. The Rust tokenizer's batch encode releases the GIL (`tokenizer.encoder`).
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-tokenize")

    async def off_loop(self, fn: Callable[[], T], num_chars: int) -> T:
        """fn() for a prompt of `num_chars` characters (tokenizing, rendering a conversation):
        right here when short, on the tokenizer's thread when long, so one long prompt does not
        stall the event loop."""
        if num_chars < OFF_LOOP_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)

    @functools.cached_property
    def _vocabulary(self) -> tuple[int, int] | None:
        """(the longest token's text in characters, one past the largest token id), or None
        where the tokenizer has no table. A byte-level vocabulary spells a byte a character, so
        no token covers more of a prompt's text than the longest one's length."""
        vocab = vocabulary(self.engine.tokenizer)
        if not vocab:
            return None
        return max(map(len, vocab)), max(vocab.values()) + 1

    @property
    def num_token_ids(self) -> int | None:
        """Token ids the tokenizer can decode are below this; None where unknown."""
        return self._vocabulary[1] if self._vocabulary is not None else None

    def check_fits(self, text: str, param: str) -> None:
        """Refuse, without tokenizing it, a text too long for the context whatever its tokens.
        A 32 MiB body would otherwise cost seconds of a core to be refused."""
        self.check_chars_fit(len(text), "prompt", param)

    def check_chars_fit(self, num_chars: int, what: str, param: str) -> None:
        """Refuse `num_chars` characters of a prompt's text (`what` names them) too many for the
        context whatever their tokens: they make at least num_chars / (longest token x
        _NORMALIZED_SHRINK) tokens."""
        if self._vocabulary is None:
            return
        at_least = num_chars // (max(self._vocabulary[0], 1) * _NORMALIZED_SHRINK)
        if at_least >= self.engine.max_model_len:
            raise errors.invalid_request(
                f"This model's maximum context length is {self.engine.max_model_len} tokens; the "
                f"{what} ({num_chars} characters) has at least {at_least}.",
                param,
            )

    @functools.cached_property
    def token_text(self) -> Any:
        """token id -> its text alone (for logprobs); cached, a vocabulary is small."""
        return _token_decoder(self.engine.tokenizer)

    @functools.cached_property
    def shown_text(self) -> Any:
        """token id -> its text as a returned text shows it (special tokens left out, as the
        detokenizer leaves them out, but for the reasoning tags it shows): where a reasoning
        block's end tag falls among a reply's tokens."""
        hidden = _token_decoder(self.engine.tokenizer, skip_special_tokens=True)
        fmt = REASONING_PARSERS.get(self.reasoning_parser or "")
        specials = special_tokens(self.engine.tokenizer)
        tags = {specials[t] for t in (fmt.start, fmt.end) if t in specials} if fmt else set()
        if not tags:
            return hidden
        shown = self.token_text
        return lambda token_id: shown(token_id) if token_id in tags else hidden(token_id)


def _itself(parsed: ModelT) -> ModelT:
    return parsed


def _validated(
    model: type[ModelT], body: bytes, serves: Callable[[object], bool], convert: Callable[[ModelT], T]
) -> T:
    """convert(the body validated as `model`, for this server's model). A ValidationError becomes
    the client's 400 here, off the loop where the body is large: reading a pydantic error list
    costs a few µs an error."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as e:
        raise errors.to_api_error(e) from None
    if not serves(getattr(parsed, "model", None)):
        raise errors.model_not_found(str(getattr(parsed, "model", "")))
    check_fields = getattr(parsed, "check_fields", None)
    if check_fields is not None:  # refused fields are 400s; unknown ones are logged
        check_fields()
    return convert(parsed)


def _token_decoder(tokenizer: Any, **decode_kwargs: bool) -> Any:
    """token id -> `tokenizer.decode([token id], **decode_kwargs)`, cached."""

    @functools.lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return str(tokenizer.decode([token_id], **decode_kwargs))

    return text


def new_id(prefix: str) -> str:
    """The response's id: `<prefix>-<request id>`, the request id adopted from x-request-id."""
    return access.response_id(prefix)


def now_s() -> int:
    return int(time.time())


def usage(finals: list[RequestOutput], num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; a chat reply's has `completion_tokens_details.reasoning_tokens` (those of
    them in reasoning blocks)."""
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(o.token_ids) for out in finals for o in out.outputs)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if num_reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return body


class RunningUsage:
    """A streamed response's usage so far, counted from the tokens its chunks carried (the
    outputs' `token_ids` may already hold tokens of steps not sent yet)."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0

    def add(self, num_tokens: int) -> dict[str, int]:
        """Count the tokens of the chunk about to be sent; the usage to send with it."""
        self.num_completion_tokens += num_tokens
        return self.as_dict()

    def as_dict(self) -> dict[str, int]:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def remaining_context(ctx: ServerContext, prompts: list[list[int]], param: str) -> int:
    """Tokens left after the longest prompt: the default max_tokens when a request gives none.
    A KV cache smaller than the context (the engine warns at start) bounds it too, or every such
    request would be refused for asking more blocks than the cache has."""
    longest = max(len(p) for p in prompts)
    room = ctx.engine.max_model_len - longest
    if room < 1:
        raise errors.invalid_request(
            f"This model's maximum context length is {ctx.engine.max_model_len} tokens; the prompt "
            f"has {longest} and leaves no room for output.",
            param,
        )
    stats = ctx.engine.stats()
    kv_room = stats.num_kv_blocks * stats.block_size - longest
    return min(room, kv_room) if kv_room >= 1 else room  # else the engine says the prompt cannot fit
