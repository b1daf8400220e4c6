"""OpenAI request bodies for /v1/chat/completions: messages (tool calls and results included),
tools, and the fields that go to the chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from corral_engine.errors import InvalidRequestError
from corral_engine.sampling_params import MAX_LOGPROBS
from corral_engine.server.api_models import _SamplingFields, _Strict
from corral_engine.server.api_tools import Tool, ToolCallItem, ToolChoice
from corral_engine.server.request_fields import REFUSED_CHAT, check_fields

# The values OpenAI's API takes (openai's `shared.ReasoningEffort`); others are 400s naming the field.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalPart(_Strict):
    """An assistant turn's refusal, as OpenAI's API returns it and clients send it back."""

    type: Literal["refusal"]
    refusal: str


class ImageUrl(_Strict):
    url: str  # data:image/...;base64,... or http(s)://...
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; one tile either way for LLaVA-1.5


class ImageUrlPart(_Strict):
    """A user turn's image (OpenAI's content part), for a vision-language model."""

    type: Literal["image_url"]
    image_url: ImageUrl


_PART_TYPES = ("text", "refusal", "image_url")
_Part = Annotated[TextPart | RefusalPart | ImageUrlPart, Field(discriminator="type")]

# Names a request's chat_template_kwargs may not set. `chat_template` would replace the model's
# template with the request's own Jinja, rendered with the server's time (its loops are bounded
# only by the request), as the refused top-level `chat_template` field would; the others are
# arguments of the renderer, not template variables, and clash with the ones it is given.
_RESERVED_TEMPLATE_KWARGS = {
    "chat_template": "the chat template is the model's; a request cannot replace it",
    **{
        name: "it is an argument of the template renderer, not a template variable"
        for name in ("conversation", "messages", "tokenize", "return_dict", "return_assistant_tokens_mask")
    },
}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[_Part], Field(fail_fast=True)] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this is the result of
    # An assistant turn's reasoning sent back (vLLM's `reasoning_content`; `reasoning` as some
    # clients name it): Qwen3 and DeepSeek templates read it as `reasoning_content`.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_part_types(cls, content: Any) -> Any:
        """Name the part a text-only model cannot take (an image, audio, a file), rather than
        pydantic's "Input should be a valid string" for the whole content."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(part, dict) and kind is None:
                    raise ValueError(f"content part {i} has no type")
                if kind is not None and kind not in _PART_TYPES:
                    raise ValueError(
                        f"content part {i} is of type {kind!r}: the chat route takes text parts, "
                        "image_url parts (a vision-language model's; text-only models refuse them) "
                        "and an assistant's refusal"
                    )
        return content

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        parts = self.content if isinstance(self.content, list) else []
        if self.role != "assistant" and any(isinstance(part, RefusalPart) for part in parts):
            raise ValueError("only assistant messages carry refusal parts")
        if self.role != "user" and any(isinstance(part, ImageUrlPart) for part in parts):
            raise ValueError("only user messages carry image_url parts")
        return self

    def template_message(self) -> dict[str, Any]:
        """As chat templates expect it: role, plain-text content, and the tool fields when set.
        Templates predate OpenAI's `developer` role, which means what `system` means to them;
        they index a call's arguments as an object, so JSON arguments are parsed (as vLLM does)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = self.text() if not self.has_images else self.template_parts()
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
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None and self.role == "assistant":
            message["reasoning_content"] = reasoning
        if self.name is not None:
            message["name"] = self.name
        return message

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImageUrlPart) for p in self.content)

    def template_parts(self) -> list[dict[str, Any]]:
        """Content with images as transformers' processor templates read it (and vLLM passes it):
        `{"type": "image"}` where each image goes, text parts as they came."""
        parts = self.content if isinstance(self.content, list) else []
        return [
            {"type": "image"} if isinstance(p, ImageUrlPart) else {"type": "text", "text": _text_of(p)}
            for p in parts
        ]

    def text(self) -> str:
        return "".join(self.pieces())

    def pieces(self) -> Iterator[str]:
        """The turn's text as it came: its content, or each part's text (or refusal); no images."""
        if isinstance(self.content, str):
            yield self.content
        elif self.content is not None:
            yield from (_text_of(p) for p in self.content if not isinstance(p, ImageUrlPart))


class ChatCompletionRequest(_SamplingFields):
    """vLLM's template fields (chat_template_kwargs, add_generation_prompt, continue_final_message,
    documents; OpenAI's reasoning_effort) go to the chat template as its keyword arguments."""

    # fail_fast: a body's first error is the one reported, and listing all of them cost as much
    # as validating (a 10 MB body of 300k bad messages: 300k errors, seconds of a core).
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool | None = None  # vLLM's: false leaves reasoning_content out (--reasoning-parser)
    add_special_tokens: bool = False  # the template writes BOS itself

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in kwargs or {}:
            reason = _RESERVED_TEMPLATE_KWARGS.get(name)
            if reason is not None:
                raise ValueError(f"`{name}` is not supported: {reason}")
        return kwargs

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_choice(cls, choice: Any) -> Any:
        """The Responses API's named form is a 400 in chat, as at OpenAI, which says which to use."""
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            raise ValueError(
                'a named tool_choice in chat is {"type": "function", "function": {"name": ...}} '
                '({"type": "function", "name": ...} is the Responses API\'s form)'
            )
        return choice

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, REFUSED_CHAT)
        self.check_stream_options()
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message needs add_generation_prompt false", "continue_final_message"
            )

    def template_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(self.chat_template_kwargs or {})
        kwargs["add_generation_prompt"] = self.add_generation_prompt
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        for name in ("documents", "reasoning_effort"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        tools = self.template_tools()
        if tools is not None:
            kwargs["tools"] = tools
        return kwargs

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
    def is_reasoning_shown(self) -> bool:
        return self.include_reasoning is not False

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_chars(self, at_most: int) -> int:
        """What rendering and tokenizing it cost, in characters, counted until past `at_most` (a
        million content parts took 0.3 s to count on the event loop): the text (a piece one more),
        and the tools, documents and template arguments (an agent's tools often outweigh its text)."""
        num = len(json.dumps([self.documents, self.chat_template_kwargs]))
        num += sum(len(t.model_dump_json(exclude_none=True)) for t in self.tools or ())
        for message in self.messages:
            for piece in message.pieces():
                if num >= at_most:
                    return num
                num += 1 + len(piece)
        return num

    def num_rendered_chars(self) -> int:
        """Characters any chat template renders: the user turns' text, less the whitespace around it
        (Llama 3's and Gemma's templates trim turns; DeepSeek-R1's and Qwen3's drop an assistant
        turn's thinking, many a role they do not know)."""
        return sum(len(m.text().strip()) for m in self.messages if m.role == "user")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def image_parts(self) -> list[tuple[str, str]]:
        """(URL, the part's name for a 400) of each image part, in the order the prompt holds them."""
        return [
            (part.image_url.url, f"messages[{i}].content[{j}].image_url")
            for i, message in enumerate(self.messages)
            if isinstance(message.content, list)
            for j, part in enumerate(message.content)
            if isinstance(part, ImageUrlPart)
        ]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as chat templates take them (OpenAI's shape, as vLLM passes it)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _text_of(part: TextPart | RefusalPart | ImageUrlPart) -> str:
    if isinstance(part, TextPart):
        return part.text
    return part.refusal if isinstance(part, RefusalPart) else ""


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
