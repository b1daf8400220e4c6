"""A chat reply as OpenAI returns it when tools are in play: content plus `tool_calls`, whole or
as stream deltas (a call's first delta carries its id and name, later ones pieces of arguments)."""

from __future__ import annotations

import uuid
from typing import Any

from corral_engine.server.api_tools import ToolPlan
from corral_engine.server.tool_parsers import ParsedCall


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call_dict(call: ParsedCall) -> dict[str, Any]:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that ended on its own and holds calls finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def reply_message(plan: ToolPlan, text: str) -> dict[str, Any]:
    """The whole reply as a chat message."""
    if plan.named is not None:
        call = {"id": new_call_id(), "type": "function", "function": {"name": plan.named, "arguments": text}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if plan.parser is None:
        return {"role": "assistant", "content": text}
    parsed = plan.parser.parse(text, is_final=True)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}
    calls = [_call_dict(c) for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}


class ReplyStream:
    """One choice's reply, fed text deltas; each feed gives the content delta and tool-call deltas
    to send. Parsed from the whole text so far each time, so chunking never changes the result."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.num_content_chars = 0
        self.num_calls = 0

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, delta: str, is_final: bool) -> tuple[str, list[dict[str, Any]]]:
        plan, parser = self.plan, self.plan.parser
        if parser is None and plan.named is None:
            return delta, []
        self.text += delta
        if plan.named is not None:
            deltas: list[dict[str, Any]] = []
            if self.num_calls == 0:
                self.num_calls = 1
                function = {"name": plan.named, "arguments": ""}
                deltas.append({"index": 0, "id": new_call_id(), "type": "function", "function": function})
            if delta:
                deltas.append({"index": 0, "function": {"arguments": delta}})
            return "", deltas
        if parser is None:
            return delta, []
        parsed = parser.parse(self.text, is_final)
        content = parsed.content[self.num_content_chars :]
        self.num_content_chars = len(parsed.content)
        new = parsed.calls[self.num_calls :]
        deltas = [{"index": self.num_calls + i, **_call_dict(c)} for i, c in enumerate(new)]
        self.num_calls = len(parsed.calls)
        return content, deltas
