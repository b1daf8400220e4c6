"""OpenAI request bodies for /v1/completions and /v1/chat/completions (pydantic, no torch).

Unknown fields are ignored, as OpenAI does; known fields are strict (no "1" for 1, no 1 for true),
so wrong types are 400s. Ranges that the engine owns are checked once, by SamplingParams.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from corral_engine.errors import InvalidRequestError
from corral_engine.sampling_params import MAX_LOGPROBS, SamplingParams
from corral_engine.server.api_structured import ResponseFormat, StructuredOutputs, grammar_of
from corral_engine.server.api_tools import Tool, ToolCallItem, ToolChoice
from corral_engine.structured.spec import GrammarSpec

TokenId = Annotated[int, Field(ge=0)]
# A bound on the number of prompts one completions request may carry (each is an engine request).
MAX_PROMPTS = 64
MAX_STOP = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage so far on every chunk


class _SamplingFields(_Strict):
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

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingFields:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop may hold at most {MAX_STOP} strings")
        return self

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
            "logprobs": logprobs,
            # Handlers read whole texts only from finished outputs; streams need only the deltas.
            "output_kind": "delta",
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
        return SamplingParams(**values)


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt must not be empty")
            if len(self.prompt) > MAX_PROMPTS and isinstance(self.prompt[0], str | list):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if isinstance(self.prompt[0], list) and any(not p for p in self.prompt):
                raise ValueError("a token-id prompt must not be empty")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one per engine request."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this is the result of

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def template_message(self) -> dict[str, Any]:
        """As chat templates expect it: role, plain-text content, and the tool fields when set.
        Templates predate OpenAI's `developer` role, which means what `system` means to them;
        they index a call's arguments as an object, so JSON arguments are parsed (as vLLM does)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = self.text()
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as chat templates take them (OpenAI's shape, as vLLM passes it)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
