"""OpenAI request bodies: the fields both endpoints share, and /v1/completions' (pydantic, no torch;
chat's are in api_chat.py).

Fields OpenAI or vLLM define are declared here or refused in request_fields.py; others are logged
and ignored, as vLLM does. Declared fields are strict (no "1" for 1, no 1 for true), so wrong types
are 400s. Ranges that the engine owns are checked once, by SamplingParams.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from corral_engine.errors import InvalidRequestError
from corral_engine.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from corral_engine.server.api_structured import ResponseFormat, StructuredOutputs, grammar_of
from corral_engine.server.request_fields import REFUSED_COMPLETION, check_fields
from corral_engine.structured.spec import GrammarSpec

TokenId = Annotated[int, Field(ge=0)]
# A bound on the number of prompts one completions request may carry (each is an engine request).
MAX_PROMPTS = 64
MAX_STOP = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Request(BaseModel):
    """A request body: unknown fields are kept aside, so refused ones are 400s and the rest are
    logged and ignored (request_fields.py)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage so far on every chunk


class _SamplingFields(_Request):
    """Fields both endpoints share; they become one SamplingParams."""

    model: str = Field(min_length=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[TokenId] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens, top k of each
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep only the prompt's last k
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    spaces_between_special_tokens: bool = True
    # Hints with nothing for this server to do (no stored completions, one service tier, prefix
    # caching is automatic): accepted, as vLLM accepts them.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingFields:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop may hold at most {MAX_STOP} strings")
        return self

    def check_stream_options(self) -> None:
        """As OpenAI's API and vLLM: stream_options only with stream."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def running_usage_in_stream(self) -> bool:
        return self.include_usage_in_stream and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, tool_grammar: GrammarSpec | None = None
    ) -> SamplingParams:
        """Build validated SamplingParams; raises SamplingError (a 400) naming the bad field.
        `tool_grammar`: what a forced tool call (required or named) constrains the reply to."""
        grammar = grammar_of(self.response_format, self.structured_outputs)
        if grammar is not None and tool_grammar is not None:
            raise InvalidRequestError(
                "A required or named tool_choice cannot be combined with another output constraint.",
                "tool_choice",
            )
        values: dict[str, Any] = {
            "max_tokens": max_tokens,
            "n": self.n,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "logprobs": logprobs,
            # Streams need only each step's deltas; a response written at the end needs only the
            # finished output (vLLM's FINAL_ONLY: no output, listener call or wake-up per step).
            "output_kind": "delta" if self.stream else "final_only",
            "grammar": grammar or tool_grammar,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if self.stop is not None:
            values["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            values["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.logit_bias:
            values["logit_bias"] = self.logit_bias  # its keys read as token ids there
        if self.allowed_token_ids is not None:
            values["allowed_token_ids"] = tuple(self.allowed_token_ids)
        values["min_tokens"] = self.min_tokens
        values["prompt_logprobs"] = self.prompt_logprobs
        return SamplingParams(**values)

    def truncate(self, prompt: list[int]) -> list[int]:
        """The prompt as the engine sees it: its last truncate_prompt_tokens tokens, if set."""
        k = self.truncate_prompt_tokens
        return prompt if k is None else prompt[-k:]


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # the prompt's text before each completion's
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # return the n likeliest of best_of
    add_special_tokens: bool = True  # text prompts: as the tokenizer adds them (BOS)

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, REFUSED_COMPLETION)
        self.check_stream_options()
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError("best_of must be at least n", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidRequestError("best_of cannot be used with stream", "best_of")

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt must not be empty")
            if len(self.prompt) > MAX_PROMPTS and isinstance(self.prompt[0], str | list):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if isinstance(self.prompt[0], list) and any(not p for p in self.prompt):
                raise ValueError("a token-id prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one per engine request."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
