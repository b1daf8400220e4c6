"""Command-line values shared by the commands and the benchmarks: checked numbers (argparse
types that refuse a bad value with one line, exit 2) and `KEY=VALUE` pairs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import TypeVar

N = TypeVar("N", int, float)
MAX_PORT = 65535


def checked(convert: Callable[[str], N], expected: str, is_ok: Callable[[N], bool]) -> Callable[[str], N]:
    """An argparse type: `convert` the text, refusing values that are not `is_ok` with one line."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not is_ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


# Counts and token lengths; seconds and spreads (NaN and inf are refused too); a temperature.
positive_int = checked(int, "an integer >= 1", lambda v: v >= 1)
positive_float = checked(float, "a number > 0", lambda v: math.isfinite(v) and v > 0)
non_negative_int = checked(int, "an integer >= 0", lambda v: v >= 0)
non_negative_float = checked(float, "a number >= 0", lambda v: math.isfinite(v) and v >= 0)
# A TCP port: the OS would take 70000 as 4464.
port_number = checked(int, f"a port number, 1 to {MAX_PORT}", lambda v: 1 <= v <= MAX_PORT)


def key_values(items: Iterable[str], what: str = "item", form: str = "KEY=VALUE") -> dict[str, str]:
    """`KEY=VALUE` items as a dict (a value may hold `=`, or be empty); ValueError naming `what`
    (the flag) and the `form` expected for an item without `=` or without a key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: expected {form}")
        out[key] = value
    return out
