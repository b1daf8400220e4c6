"""What the request handlers share: the engine, metrics, lifecycle flags, and body parsing."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from corral_engine.outputs import RequestOutput
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import access, errors
from corral_engine.server.engine_client import EngineClient
from corral_engine.server.generation import GenerationRun, InFlight
from corral_engine.server.metrics import ServerMetrics
from corral_engine.tokenizer import encoder

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass
class ServerContext:
    engine: EngineClient
    metrics: ServerMetrics
    api_key: str | None = None
    tool_call_parser: str | None = None  # --tool-call-parser: enables tool_choice "auto"
    in_flight: InFlight = field(default_factory=InFlight)
    is_ready: bool = False
    is_draining: bool = False

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    async def parse(self, request: Request, model: type[ModelT]) -> ModelT:
        """Read and validate a JSON body; every failure is a 4xx APIError or ValidationError."""
        if self.is_draining:
            raise errors.draining()
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise errors.APIError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")
        parsed = model.model_validate_json(body)
        if getattr(parsed, "model", None) != self.model_name:
            raise errors.model_not_found(str(getattr(parsed, "model", "")))
        check_fields = getattr(parsed, "check_fields", None)
        if check_fields is not None:  # refused fields are 400s; unknown ones are logged
            check_fields()
        return parsed

    def start_run(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> GenerationRun:
        return GenerationRun(self.engine, self.metrics, self.in_flight, request_id, prompts, params)

    @functools.cached_property
    def encode(self) -> Callable[[str], list[int]]:
        """text -> token ids, as the tokenizer's own `encode` gives them (`tokenizer.encoder`)."""
        return encoder(self.engine.tokenizer)

    @functools.cached_property
    def token_text(self) -> Any:
        """token id -> its text alone (for logprobs); cached, a vocabulary is small."""
        tokenizer = self.engine.tokenizer

        @functools.lru_cache(maxsize=65536)
        def text(token_id: int) -> str:
            return str(tokenizer.decode([token_id]))

        return text


def new_id(prefix: str) -> str:
    """The response's id: `<prefix>-<request id>`, the request id adopted from x-request-id."""
    return access.response_id(prefix)


def now_s() -> int:
    return int(time.time())


def usage(finals: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(o.token_ids) for out in finals for o in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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
    """Tokens left after the longest prompt: the default max_tokens when a request gives none."""
    room = ctx.engine.max_model_len - max(len(p) for p in prompts)
    if room < 1:
        raise errors.invalid_request(
            f"This model's maximum context length is {ctx.engine.max_model_len} tokens; the prompt "
            f"has {max(len(p) for p in prompts)} and leaves no room for output.",
            param,
        )
    return room
