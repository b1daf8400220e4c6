"""An option table: the options a dataclass declares in its fields, read once (each one's `Option`,
default, annotation and value check), and what is derived per option: its flag, its default as the
docs say it, its value type; the values checked against them (light; no torch)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from corral_engine.field_types import WrongType, checker, describe, got
from corral_engine.options import ArgumentError, AtMost, Exclusive, Option, broken_rule, scalar_type


class OptionTable:
    """The options of a dataclass whose every field carries an `Option` (metadata key "option"),
    in field order."""

    def __init__(self, declaring: type[Any]) -> None:
        fields = dataclasses.fields(declaring)
        self.options: dict[str, Option] = {f.name: f.metadata["option"] for f in fields}
        self.defaults: dict[str, object] = {
            f.name: f.default for f in fields if f.default is not dataclasses.MISSING
        }
        self._hints = typing.get_type_hints(declaring)  # resolved once: the annotations are strings
        self._checks = {name: checker(self._hints[name]) for name in self.options}

    def conform(self, values: object) -> None:
        """Each of `values`' fields checked against its annotation and set to what the check made
        of it (numbers Python's own), so a wrong type is refused here, naming the option."""
        for name, check in self._checks.items():
            value = getattr(values, name)
            try:
                object.__setattr__(values, name, check(value))
            except WrongType:
                raise ArgumentError(
                    f"{name} must be {describe(self._hints[name])}, got {got(value)}"
                ) from None

    def check(self, values: object, rules: tuple[Exclusive | AtMost, ...]) -> None:
        """Each of `values`' fields within its option's bounds, and no rule over two broken."""
        for name, option in self.options.items():
            value = getattr(values, name)
            problem = None if value is None else option.problem(value)
            if problem is not None:
                raise ArgumentError(f"{name} {problem}, got {value!r}")
        rule = broken_rule({name: getattr(values, name) for name in self.options}, rules)
        if rule is not None:
            raise ArgumentError(rule.message())

    def cli_args(self, values: object) -> list[str]:
        """`values` as flags, in field order: a required option always, others where not None or
        their default."""
        out: list[str] = []
        for name in self.options:
            value = getattr(values, name)
            if value is None or (name in self.defaults and value == self.defaults[name]):
                continue
            if isinstance(value, bool):
                out.append(self.cli_flag(name))  # a bool flag says "not the default"
            elif isinstance(value, tuple):
                out += [self.cli_flag(name), *map(str, value)]  # a list flag takes its items after it
            else:
                out += [self.cli_flag(name), str(value)]
        return out

    def cli_flag(self, name: str) -> str:
        """The `corral engine` flag of option `name`."""
        return self.options[name].flag or "--" + name.replace("_", "-")

    def default_text(self, name: str) -> str:
        """The option's default as the help and docs say it."""
        option = self.options[name]
        if option.default_text is not None:
            return option.default_text
        default = self.defaults.get(name, "required")
        if isinstance(default, bool):
            return "on" if default else "off"
        return str(default)

    def value_type(self, name: str) -> type:
        """The Python type of option `name`'s values: bool, int, float or str (a Literal's values are
        str; a list option's, its items' type)."""
        return scalar_type(self._hints[name])

    def is_list(self, name: str) -> bool:
        """Whether option `name` takes several values (a tuple: `--lora-modules A=/a B=/b`)."""
        return typing.get_origin(_non_none(self._hints[name])) is tuple


def _non_none(hint: Any) -> Any:
    """X from `X | None`; any other annotation as it is."""
    args = typing.get_args(hint)
    if type(None) not in args:
        return hint
    (kind,) = [a for a in args if a is not type(None)]
    return kind
