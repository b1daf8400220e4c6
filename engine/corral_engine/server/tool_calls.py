"""A chat reply as OpenAI returns it when tools are in play: content plus `tool_calls`, whole or
as stream deltas. A call's first delta carries its index, id, type and name (arguments ""); later
ones carry its index and the next piece of its arguments, as the model writes them. With a
reasoning parser, a reply's reasoning block is `reasoning` (and `reasoning_content`), and only the
rest is read for calls."""

from __future__ import annotations

from typing import Any

from corral_engine.server.api_tools import ToolPlan
from corral_engine.server.reasoning import (
    Reasoning,
    ReasoningPlan,
    ReasoningSplitter,
    reasoning_fields,
    split_whole,
)
from corral_engine.server.tool_parsers import (
    CallStart,
    Content,
    ToolEvent,
    ToolParser,
    parse_whole,
)


def _call_dict(plan: ToolPlan, name: str, arguments: str) -> dict[str, Any]:
    return {"id": plan.new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that ended on its own and holds calls finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def reply_message(plan: ToolPlan, text: str, reasoning: ReasoningPlan | None = None) -> dict[str, Any]:
    """The whole reply as a chat message."""
    if reasoning is None:
        return _content_message(plan, text)
    thought, text = split_whole(reasoning, text)
    message = _content_message(plan, text)
    if thought is not None and not message["content"]:
        message["content"] = None  # all reasoning: a block never closed, or nothing after it
    if reasoning.is_shown:
        message.update(reasoning_fields(thought))
    return message


def _content_message(plan: ToolPlan, text: str) -> dict[str, Any]:
    if plan.named is not None:
        return {"role": "assistant", "content": None, "tool_calls": [_call_dict(plan, plan.named, text)]}
    if plan.make_parser is None:
        return {"role": "assistant", "content": text}
    parsed = parse_whole(plan.make_parser, text)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}
    calls = [_call_dict(plan, c.name, c.arguments) for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}


def _header(plan: ToolPlan, index: int, name: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **_call_dict(plan, name, "")}]}


def _arguments(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def event_deltas(plan: ToolPlan, events: list[ToolEvent]) -> list[dict[str, Any]]:
    """Chunk deltas for a feed's events: a run of content is one delta, a call's start one, and a
    run of one call's argument pieces one."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        last = deltas[-1] if deltas else {}
        if isinstance(event, Content):
            if "content" in last:
                last["content"] += event.text
            else:
                deltas.append({"content": event.text})
        elif isinstance(event, CallStart):
            deltas.append(_header(plan, event.index, event.name))
        else:
            pending = last.get("tool_calls", [{}])[0]
            if pending.get("index") == event.index and "id" not in pending:
                pending["function"]["arguments"] += event.text
            else:
                deltas.append(_arguments(event.index, event.text))
    return deltas


class ReplyStream:
    """One choice's reply, fed text deltas; each feed gives the chunk deltas to send, in order
    (reasoning before the content that follows it)."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningPlan | None = None) -> None:
        self.plan = plan
        self.parser: ToolParser | None = plan.make_parser() if plan.make_parser is not None else None
        self.splitter: ReasoningSplitter | None = reasoning.splitter() if reasoning is not None else None
        self.is_reasoning_shown = reasoning is not None and reasoning.is_shown
        self.num_calls = 0

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, delta: str, is_final: bool) -> list[dict[str, Any]]:
        if self.splitter is None:
            return self._content(delta, is_final)
        events = self.splitter.feed(delta)
        if is_final:
            events += self.splitter.finish()
        thought = "".join(e.text for e in events if isinstance(e, Reasoning))
        deltas = [reasoning_fields(thought)] if thought and self.is_reasoning_shown else []
        content = "".join(e.text for e in events if not isinstance(e, Reasoning))
        return deltas + self._content(content, is_final)

    def _content(self, delta: str, is_final: bool) -> list[dict[str, Any]]:
        if self.plan.named is not None:
            deltas = []
            if self.num_calls == 0 and (delta or is_final):  # not before its reasoning is over
                self.num_calls = 1
                deltas.append(_header(self.plan, 0, self.plan.named))
            if delta:
                deltas.append(_arguments(0, delta))
            return deltas
        if self.parser is None:
            return [{"content": delta}] if delta else []
        events = self.parser.feed(delta)
        if is_final:
            events += self.parser.finish()
        self.num_calls += sum(isinstance(e, CallStart) for e in events)
        return event_deltas(self.plan, events)
