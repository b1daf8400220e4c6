"""OpenAI request bodies for POST /v1/responses, and their translation into the chat request the
engine already serves: `input` and `instructions` become messages, flat function tools become chat
tools, `text.format` becomes `response_format`. Nothing is stored, so nothing refers back."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from corral_engine.errors import InvalidRequestError
from corral_engine.server.api_chat import ChatCompletionRequest, ReasoningEffort
from corral_engine.server.api_models import _Request, _Strict
from corral_engine.server.request_fields import Refused, check_fields

_NOT_STORED = "this server stores no responses or conversations: send the whole conversation as input"
# Fields of OpenAI's Responses API this server does not implement: a value other than the neutral
# ones is a 400 naming the field (`store` and `reasoning` are declared: see ResponsesRequest).
REFUSED_RESPONSES: dict[str, Refused] = {
    "previous_response_id": Refused(_NOT_STORED),
    "conversation": Refused(_NOT_STORED),
    "prompt": Refused("stored prompt templates are not available: send the prompt as input"),
    "background": Refused(
        "background responses need a store; this server answers in the request", (None, False)
    ),
    "max_tool_calls": Refused("the model makes the calls it makes; the client decides which to run"),
    "top_logprobs": Refused(
        "logprobs are not returned on /v1/responses (use /v1/chat/completions)", (None, 0)
    ),
    "truncation": Refused("the input is never truncated: a too-long one is refused", (None, "disabled")),
    "context_management": Refused("the input is never compacted"),
}
# Hosted tools run on OpenAI's side; here the client runs every tool.
_FUNCTION_ONLY = "only function tools are available here (the client runs them); hosted tools such as "
# Stateless clients ask for encrypted reasoning to send back; reasoning items here carry their text
# in the clear (`content`), which is what is sent back, so this asks for nothing more.
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
_INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Strict):
    """An image for a vision-language model: chat's image_url part (no stored files here)."""

    type: Literal["input_image"]
    image_url: str | None = None  # data:image/...;base64,... or http(s)://...
    detail: Literal["auto", "low", "high"] | None = None
    file_id: str | None = None

    def chat_part(self) -> dict[str, Any]:
        if self.image_url is None:
            raise InvalidRequestError(
                "an input_image needs an image_url: this server stores no files", "input"
            )
        url = {"url": self.image_url, "detail": self.detail}
        return {"type": "image_url", "image_url": {k: v for k, v in url.items() if v is not None}}


Part = Annotated[InputText | Refusal | InputImage, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[Part], Field(fail_fast=True)]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(
            p.text if isinstance(p, InputText) else p.refusal
            for p in self.content
            if not isinstance(p, InputImage)
        )

    def chat_content(self) -> str | list[dict[str, Any]]:
        """Its text, or chat's content parts where it holds images (each where it came)."""
        if isinstance(self.content, str) or not any(isinstance(p, InputImage) for p in self.content):
            return self.text()
        return [
            p.chat_part() if isinstance(p, InputImage) else {"type": "text", "text": _part_text(p)}
            for p in self.content
        ]


def _part_text(part: InputText | Refusal) -> str:
    return part.text if isinstance(part, InputText) else part.refusal


class FunctionCallItem(_Strict):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Strict):
    """The client's result of running a call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """A reasoning item from an earlier response: its text is the next assistant turn's
    `reasoning_content`, as chat's assistant messages carry it (Qwen3's and DeepSeek's templates
    write it back only where it matters: after the last user message, in a tool loop). Its
    summary and encrypted content (none is made here) are ignored."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None

    def text(self) -> str | None:
        return "".join(part.text for part in self.content or ()) or None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]


class FunctionTool(_Strict):
    """A function tool in the Responses API's flat shape (the chat API nests it under `function`)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")  # as chat's
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise InvalidRequestError("text.format of type json_schema needs a schema", "text.format.schema")
        schema = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint for OpenAI's reasoning models; nothing to do here


# The values OpenAI's API takes (openai's `shared.Reasoning` type): others are 400s naming the field.
Summary = Literal["auto", "concise", "detailed"]


class Reasoning(_Strict):
    """OpenAI's reasoning options: `effort` reaches the chat template as `reasoning_effort`
    (as the chat API's field does); summaries are not made, so `summary` asks for nothing, nor do
    `context` (reasoning items sent back are always used) and `mode`."""

    effort: ReasoningEffort | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None  # OpenAI's deprecated name for `summary`
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


def _check_parts(index: int, content: Any) -> None:
    """Name a content part no model here takes (a file, audio), rather than pydantic's error for
    the whole union."""
    for i, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "refusal", "input_image"):
            raise ValueError(
                f"item {index} content part {i} is of type {kind!r}: parts here are text, refusals and "
                "input_image (a vision-language model's); files and audio are not taken"
            )


class ResponsesRequest(_Request):
    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(fail_fast=True)]  # the first error only
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    # Sampling fields OpenAI's Responses API lacks but chat (and vLLM) take: passed on as they are.
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    # vLLM's, as on chat: special tokens left out of the reply's text (its tool parser's markers
    # are still read).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation is sent
    user: str | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    # Accepted whatever its value, as vLLM does without its store: nothing is stored, and the
    # response says `"store": false`; a later GET of its id is a 404 saying so.
    store: bool | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_items(cls, items: Any) -> Any:
        """Messages may omit `type` (OpenAI's "easy" input message); other item kinds are named."""
        if not isinstance(items, list):
            return items
        if not items:
            raise ValueError("input must not be empty")
        out = []
        for i, item in enumerate(items):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "item_reference":
                raise ValueError(f"item {i} is a reference: {_NOT_STORED}")
            if kind not in _INPUT_ITEM_TYPES:
                raise ValueError(
                    f"item {i} is of type {kind!r}: input items here are messages, function_call, "
                    "function_call_output and reasoning"
                )
            if kind != "reasoning":  # its parts are reasoning_text
                _check_parts(i, item.get("content", item.get("output")))
            out.append(item)
        return out

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tool_types(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} is of type {kind!r}: {_FUNCTION_ONLY}{kind} are not")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_choice(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind is not None and kind != "function":
            raise ValueError(f"tool_choice of type {kind!r} is not available: {_FUNCTION_ONLY}{kind} are not")
        return choice

    def check_fields(self) -> None:
        check_fields(self.model_extra or {}, REFUSED_RESPONSES)
        for name in self.include or ():
            if name not in _INCLUDABLE:
                raise InvalidRequestError(f"include `{name}` is not available on this server", "include")

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` then `input`, as chat messages: a function_call joins the assistant turn
        just before it (or starts one), a function_call_output is a tool message."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        thought = None  # a reasoning item's text, for the assistant turn it comes before
        for item in self.input:
            if isinstance(item, ReasoningItem):
                thought = item.text()
                continue
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.chat_content()})
            elif isinstance(item, FunctionCallItem):
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                if out and out[-1]["role"] == "assistant" and thought is None:
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            if thought is not None and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"] = thought
            thought = None
        if not out:
            raise InvalidRequestError("input holds no messages", "input")
        return out

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this asks for (its `stream` included), validated as chat's own."""
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_tokens": self.max_output_tokens,
            **{name: getattr(self, name) for name in _SAMPLING},
            "stream": self.stream,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [t.chat_tool() for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice == "required" or (self.tools and self.tool_choice is not None):
            # "auto" or "none" without tools asks for nothing here, as on OpenAI's API.
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            fields["response_format"] = fmt.response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:  # what the Responses models let through but chat refuses
            details = e.errors()
            message = str(details[0]["msg"]).removeprefix("Value error, ") if details else "invalid input"
            raise InvalidRequestError(f"input: {message}", "input") from e
