"""A field's value checked against its annotation: the one type check of `EngineArgs` and
`SamplingParams`, run before their range checks (light; no torch).

Range checks compare with `<`, so a wrong type either raised a bare TypeError from inside them or
slipped through (`max_tokens=2.5` ran three tokens; `max_model_len="100"` failed in the model).
"""

from __future__ import annotations

import numbers
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

Check = Callable[[object], object]


class WrongType(TypeError):
    """The value does not fit the annotation (`describe` says what would)."""


def checker(hint: Any) -> Check:
    """A function taking a value to what a field annotated `hint` holds, or raising WrongType; the
    annotation is read once, here (SamplingParams are built per request). Numbers become Python's
    own int and float (numpy's scalars too; an int where a float is wanted) and any list or tuple
    (not a string) a tuple; a bool is not a number here, nor is 2.5 an int or "100" a number. A
    Literal takes any value of its values' type: which of them is allowed is for the range checks."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return _union([checker(a) for a in args if a is not type(None)], type(None) in args)
    if origin is Literal:
        return _instance(tuple({type(a) for a in args}))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _tuple_of(checker(args[0]))
        return _fixed_tuple([checker(a) for a in args])
    if hint is int:
        return _int
    if hint is float:
        return _float
    return _instance((hint,))


def describe(hint: Any) -> str:
    """What `hint` accepts, as the error says it: "int", "float", "list of int", "str or None"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {describe(args[0])}"
        return "(" + ", ".join(describe(a) for a in args) + ")"
    if hint is type(None):
        return "None"
    return str(getattr(hint, "__name__", hint))


def got(value: object) -> str:
    """The value an error names: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _int(value: object) -> int:
    if type(value) is int:
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise WrongType


def _float(value: object) -> float:
    if type(value) is float:
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise WrongType


def _instance(kinds: tuple[type, ...]) -> Check:
    def check(value: object) -> object:
        if isinstance(value, kinds):
            return value
        raise WrongType

    return check


def _union(arms: list[Check], allows_none: bool) -> Check:
    def check(value: object) -> object:
        if value is None and allows_none:
            return None
        for arm in arms:
            try:
                return arm(value)
            except WrongType:
                continue
        raise WrongType

    return check


def _items(value: object) -> tuple[object, ...]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise WrongType
    return tuple(value)


def _tuple_of(item: Check) -> Check:
    def check(value: object) -> tuple[object, ...]:
        return tuple(item(v) for v in _items(value))

    return check


def _fixed_tuple(items: list[Check]) -> Check:
    def check(value: object) -> tuple[object, ...]:
        values = _items(value)
        if len(values) != len(items):
            raise WrongType
        return tuple(c(v) for c, v in zip(items, values, strict=True))

    return check
