"""A Responses API answer: its output items (the reasoning, an assistant message, function calls),
its usage, and the response object that carries them, whole or as a stream's lifecycle events show
it."""

from __future__ import annotations

import uuid
from typing import Any

from corral_engine.outputs import RequestOutput
from corral_engine.server.api_responses import ResponsesRequest
from corral_engine.server.api_tools import ToolPlan
from corral_engine.server.reasoning import ReasoningPlan
from corral_engine.server.tool_calls import reply_message


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_call_id() -> str:
    """A function call's `call_id`, as OpenAI's look (chat's calls keep their own ids)."""
    return new_item_id("call")


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The reply's reasoning block as a reasoning item, its text in the clear (no summary is made,
    nothing is encrypted); `text` None while a stream has not opened its one text part."""
    content = [] if text is None else [reasoning_part(text)]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; `text` None while a stream has not opened its one text part."""
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def status_of(finish_reason: str | None) -> str:
    """A response (or item) cut short by the token limit is "incomplete", as OpenAI marks it."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(
    plan: ToolPlan, text: str, finish_reason: str | None, reasoning: ReasoningPlan | None = None
) -> list[dict[str, Any]]:
    """The whole reply's items: its reasoning block (with --reasoning-parser), its text as a
    message (left out when only whitespace stands beside reasoning or tool calls), then one
    function_call item per call. The last item is the one a token limit cut short, as a stream
    marks it."""
    reply = reply_message(plan, text, reasoning)
    calls = reply.get("tool_calls") or []
    content = reply["content"] or ""
    thought = reply.get("reasoning")
    items = []
    if thought:
        items.append(reasoning_item(new_item_id("rs"), thought, "completed"))
    if content.strip() or not (calls or thought):
        items.append(message_item(new_item_id("msg"), content, "completed"))
    for call in calls:
        fn = call["function"]
        items.append(
            function_call_item(new_item_id("fc"), new_call_id(), fn["name"], fn["arguments"], "completed")
        )
    items[-1]["status"] = status_of(finish_reason)
    return items


def usage(final: RequestOutput | None, num_reasoning_tokens: int = 0) -> dict[str, Any]:
    if final is None:
        num_input = num_output = num_cached = 0
    else:
        num_input = len(final.prompt_token_ids)
        num_output = sum(len(o.token_ids) for o in final.outputs)
        num_cached = final.metrics.num_cached_tokens
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": num_cached},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
        "total_tokens": num_input + num_output,
    }


class ResponseShell:
    """The response object's fields that echo the request, built once per response; `body()` adds
    the state, the output and the usage (last, where the gateway reads a body's usage from its
    end)."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, created_at: int) -> None:
        fmt = req.text.format if req.text is not None else None
        self.response_id = response_id
        self.fields: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
            "model": model,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": False,
            "background": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": _choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "truncation": "disabled",
            "user": req.user,
        }

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        final: RequestOutput | None = None,
        num_reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        """`status`: "in_progress" (a stream's first events, no usage yet), "completed" or
        "incomplete" (the output ended at the token limit)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {**self.fields, "status": status, "error": None, "incomplete_details": incomplete}
        body["output"] = output
        body["usage"] = usage(final, num_reasoning_tokens) if status != "in_progress" else None
        return body


def _choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()
