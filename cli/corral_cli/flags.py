"""Command-line items shared by the commands and the benchmarks: `KEY=VALUE` pairs."""

from __future__ import annotations

from collections.abc import Iterable


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
