"""What a tool-call parser says as it reads a reply (content, a call's start, its arguments), and
the pieces every parser shares: the reader of one call object and the held-back rule for markers."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from corral_engine.server.call_scanner import CallScanner


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # 0, 1, ... in the order the reply names them
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = Content | CallStart | ArgumentsDelta
# A request's functions: each name and its `parameters` schema (a mapping is a collection of the
# names, which is all most parsers read; qwen3_coder types its values by the schemas).
ToolSchemas = Mapping[str, Mapping[str, Any] | None]


class ToolParser(Protocol):
    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...  # the reply ended: whatever was held back


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallReader:
    """One call object being read. Its events begin once its name is known; arguments read
    before that (a model may write them first) wait for it. With `names`, an object naming
    anything else is not a call (it is over, never started)."""

    def __init__(
        self, index: int, names: Collection[str] | None = None, scanner: CallScanner | None = None
    ) -> None:
        self.index = index
        self.scanner = scanner if scanner is not None else CallScanner()
        self.is_started = False
        self.is_refused = False
        self._names = names
        self._early = ""

    @property
    def is_over(self) -> bool:
        return self.scanner.is_done or self.scanner.is_failed or self.is_refused

    def feed(self, text: str, start: int, out: list[ToolEvent]) -> int:
        end = self.scanner.feed(text, start)
        arguments = self.scanner.take_arguments()
        if not self.is_started:
            if self.scanner.name is None:
                self._early += arguments
                return end
            if self._names is not None and self.scanner.name not in self._names:
                self.is_refused = True
                return end
            self.is_started = True
            out.append(CallStart(self.index, self.scanner.name))
            arguments, self._early = self._early + arguments, ""
        if arguments:
            out.append(ArgumentsDelta(self.index, arguments))
        return end
