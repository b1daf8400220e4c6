"""A streamed Responses API answer: the typed SSE events OpenAI's clients read (`event: <type>` and
a JSON `data` with a `sequence_number`), built from the chat path's reply deltas.

The lifecycle events (response.created, response.in_progress) go out with the first tokens, as a
chat stream's role chunk does: the gateway takes a stream's first bytes for its prompt's end and
may still retry elsewhere before them. The stream ends with response.completed (or
response.incomplete at the token limit), without chat's `data: [DONE]`, as OpenAI's ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from corral_engine.outputs import RequestOutput
from corral_engine.server import errors
from corral_engine.server.api_tools import ToolPlan
from corral_engine.server.generation import GenerationRun
from corral_engine.server.reasoning import ReasoningPlan
from corral_engine.server.responses_output import (
    ResponseShell,
    function_call_item,
    message_item,
    new_call_id,
    new_item_id,
    reasoning_item,
    reasoning_part,
    status_of,
    text_part,
)
from corral_engine.server.streaming import EngineStreamingResponse
from corral_engine.server.tool_calls import ReplyStream

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class ResponseEvents:
    """One response's events, fed the run's outputs (one prompt, one choice). At most one output
    item is open at a time: reasoning opens a reasoning item, text a message, a tool call's start
    closes what is open and opens a function_call. Whitespace-only text is held until more text
    comes, so the whitespace a model writes before a call does not become a message of its own (as
    the whole reply leaves it out). `count_reasoning` gives the usage's reasoning tokens."""

    def __init__(
        self,
        shell: ResponseShell,
        plan: ToolPlan,
        reasoning: ReasoningPlan | None = None,
        count_reasoning: Callable[[list[RequestOutput]], int] | None = None,
    ) -> None:
        self.shell = shell
        self.reply = ReplyStream(plan, reasoning)
        self.count_reasoning = count_reasoning
        self.num_events = 0
        self.items: list[dict[str, Any]] = []  # the output so far; the last may be open
        self.is_open = False
        self.held = ""  # whitespace not yet shown
        self.is_started = False
        self.final: RequestOutput | None = None
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.num_events}
        self.num_events += 1
        return b"event: " + kind.encode() + b"\ndata: " + _JSON.encode(payload).encode() + b"\n\n"

    def feed(self, prompt_index: int, out: RequestOutput) -> list[bytes]:
        events = []
        if not self.is_started:
            self.is_started = True
            body = self.shell.body("in_progress", [])
            events += [
                self.event("response.created", response=body),
                self.event("response.in_progress", response=body),
            ]
        o = out.outputs[0]
        for delta in self.reply.feed(o.delta_text, o.finish_reason is not None):
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    events += self._open_call(call["function"]["name"])
                events += self._arguments(call["function"]["arguments"])
        if out.finished:
            self.final, self.finish_reason = out, o.finish_reason
        return events

    def end(self) -> list[bytes]:
        status = status_of(self.finish_reason)
        events = self._close(status)
        if not self.items:  # a reply of nothing (or only whitespace) is still a message
            events += self._open_message(self.held) + self._close(status)
        finals = [self.final] if self.final is not None else []
        num_reasoning = self.count_reasoning(finals) if self.count_reasoning is not None else 0
        body = self.shell.body(status, self.items, self.final, num_reasoning)
        return [*events, self.event(f"response.{status}", response=body)]

    def error_event(self, error: BaseException) -> bytes:
        err = errors.error_payload(error)["error"]
        return self.event(
            "error", code=err["code"] or err["type"], message=err["message"], param=err["param"]
        )

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _reasoning(self, text: str) -> list[bytes]:
        events = []
        if not (self.is_open and self.items[-1]["type"] == "reasoning"):
            events = self._open_reasoning()
        self.items[-1]["content"][0]["text"] += text
        delta = self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        return [*events, delta]

    def _open_reasoning(self) -> list[bytes]:
        events = self._close("completed")
        item = reasoning_item(new_item_id("rs"), None, "in_progress")
        self.items.append(item)
        self.is_open = True
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        item["content"].append(reasoning_part(""))
        part = reasoning_part("")
        events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _text(self, text: str) -> list[bytes]:
        if self.is_open and self.items[-1]["type"] == "message":
            self.items[-1]["content"][0]["text"] += text
            return [
                self.event(
                    "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[]
                )
            ]
        if not (self.held + text).strip():
            self.held += text
            return []
        text, self.held = self.held + text, ""
        return self._close("completed") + self._open_message("") + self._text(text)

    def _open_message(self, text: str) -> list[bytes]:
        item = message_item(new_item_id("msg"), None, "in_progress")
        self.items.append(item)
        self.is_open = True
        added = self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        item["content"].append(text_part(text))
        return [
            added,
            self.event("response.content_part.added", **self._where(), content_index=0, part=text_part(text)),
        ]

    def _open_call(self, name: str) -> list[bytes]:
        self.held = ""
        events = self._close("completed")
        item = function_call_item(new_item_id("fc"), new_call_id(), name, "", "in_progress")
        self.items.append(item)
        self.is_open = True
        return [
            *events,
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=item),
        ]

    def _arguments(self, text: str) -> list[bytes]:
        if not text or not self.is_open or self.items[-1]["type"] != "function_call":
            return []
        self.items[-1]["arguments"] += text
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def _close(self, status: str) -> list[bytes]:
        """Close the open item, if any, with `status`."""
        if not self.is_open:
            return []
        self.is_open = False
        item, where = self.items[-1], self._where()
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]
                )
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            done = {"name": item["name"], "arguments": item["arguments"]}
            events.append(self.event("response.function_call_arguments.done", **where, **done))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events


class ResponseStreamingResponse(EngineStreamingResponse):
    """The run's events; a failure after the start ends it with an `error` event."""

    def __init__(self, run: GenerationRun, events: ResponseEvents) -> None:
        super().__init__(run, events)
        self._events = events

    def closing_events(self, error: BaseException | None) -> list[bytes]:
        return [] if error is None else [self._events.error_event(error)]
