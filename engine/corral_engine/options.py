"""The vocabulary engine options are declared in: `Option` (help, bounds, flag, CRD field, vLLM
equivalent), the two-option rules, and the one byte-size grammar (light; no torch).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# Byte sizes everywhere (flags, CRD fields): a number with an optional Kubernetes-style suffix and
# an optional trailing B: 1073741824, 512Mi, 512MiB, 4Gi, 2G, 1.5Gi.
_BYTES = r"([0-9]+(?:\.[0-9]+)?)(k|M|G|T|Ki|Mi|Gi|Ti)?B?"
BYTES_PATTERN = f"^{_BYTES}$"  # for JSON schemas (the CRD)
_BYTE_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BYTE_UNITS |= {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


class ArgumentError(ValueError):
    """An engine argument is invalid; the message names the argument and the allowed values."""


def parse_bytes(text: str) -> int:
    """`1073741824`, `512Mi`, `512MiB`, `2G`, `1.5Gi` -> bytes (whole bytes, rounded down)."""
    match = re.fullmatch(_BYTES, text.strip())
    if match is None:
        raise ArgumentError(f"not a byte size: {text!r} (e.g. 1073741824, 512Mi, 4Gi, 2G)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2) or ""])


@dataclass(frozen=True, slots=True)
class Vllm:
    """vLLM's equivalent of an option: its own flag, or a key of a JSON-valued flag; `also`: flags
    vLLM needs beside it (vLLM wants --enable-auto-tool-choice with --tool-call-parser)."""

    flag: str
    json_key: str | None = None
    also: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Option:
    """How one engine option reads outside Python. Bounds are inclusive; None means unbounded."""

    help: str
    default_text: str | None = None  # the default as people say it, where not the literal value
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    ge: float | None = None  # int bounds for int options, float bounds for float ones
    le: float | None = None
    is_power_of_two: bool = False
    is_bytes: bool = False
    flag: str | None = None  # the `corral engine` flag, where not --<field-name>
    crd: str | None = None  # camelCase path under spec.engine.args; None: not in an LLMDeployment
    crd_default: int | str | None = None  # the CRD's default once the enclosing object is given
    vllm: Vllm | None = None  # None: no vLLM equivalent (a corral-engine-only option)

    def problem(self, value: object) -> str | None:
        """Why `value` is out of this option's bounds ("must be ..."), or None."""
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        if self.is_power_of_two and (value < 1 or int(value) != value or int(value) & (int(value) - 1)):
            return f"must be a power of two between {self.ge} and {self.le}"
        too_low = self.ge is not None and value < self.ge
        too_high = self.le is not None and value > self.le
        if too_low or too_high:
            return f"must be >= {self.ge}" if self.le is None else f"must be in [{self.ge}, {self.le}]"
        return None


def option_field(default: object, **declared: Any) -> Any:
    """A dataclass field of `default` declaring its option (`Option(**declared)`)."""
    return dataclasses.field(default=default, metadata={"option": Option(**declared)})


@dataclass(frozen=True, slots=True)
class Exclusive:
    """At most one of two options may be set."""

    first: str
    second: str

    @property
    def names(self) -> tuple[str, str]:
        return (self.first, self.second)

    def message(self, name: Callable[[str], str] = str) -> str:
        return f"give either {name(self.first)} or {name(self.second)}, not both"


@dataclass(frozen=True, slots=True)
class AtMost:
    """`low` <= `high` when both are set."""

    low: str
    high: str
    why: str = ""

    @property
    def names(self) -> tuple[str, str]:
        return (self.low, self.high)

    def message(self, name: Callable[[str], str] = str) -> str:
        because = f" ({self.why})" if self.why else ""
        return f"{name(self.low)} must be <= {name(self.high)}{because}"


def broken_rule(values: dict[str, Any], rules: tuple[Exclusive | AtMost, ...]) -> Exclusive | AtMost | None:
    """The first rule that `values` (option name -> value, unset ones absent or None) breaks."""
    for rule in rules:
        if isinstance(rule, Exclusive):
            if values.get(rule.first) is not None and values.get(rule.second) is not None:
                return rule
        else:
            low, high = values.get(rule.low), values.get(rule.high)
            if low is not None and high is not None and low > high:
                return rule
    return None


def scalar_type(hint: Any) -> type:
    """bool, int, float or str from an option's annotation (`X | None` is X; a Literal is its
    values' type; `tuple[X, ...]` is X)."""
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    (kind,) = [a for a in (typing.get_args(hint) if is_union else (hint,)) if a is not type(None)]
    if typing.get_origin(kind) is Literal:
        return type(typing.get_args(kind)[0])
    if typing.get_origin(kind) is tuple:  # a list option: its items' type
        return scalar_type(typing.get_args(kind)[0])
    return kind  # type: ignore[no-any-return]
