"""The CRD's `spec.engine.args`, derived from the engine's option declarations (corral_engine.args).

Each option with a `crd` path becomes a typed field with the engine's own bounds; a dotted path
(`speculative.method`) puts the field in a nested object. The engine's two-option rules become CEL
rules (checked by the API server) and the same checks in pydantic (the operator re-checks).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from corral_engine.args import (
    BYTES_PATTERN,
    OPTIONS,
    RULES,
    AtMost,
    Exclusive,
    Option,
    broken_rule,
    is_list,
    parse_bytes,
    value_type,
)
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.alias_generators import to_camel, to_snake

# Descriptions of the nested objects (the first segment of a dotted `crd` path).
GROUP_DESCRIPTIONS = {
    "speculative": "Speculative decoding, off unless given: n-gram drafts from the request's own tokens, "
    "verified in one step; greedy output unchanged.",
}
# A rule of the CRD's own beyond the engine's: vLLM refuses a token budget below the sequence
# count; Corral's engine allows it (its tests chunk prompts with tiny budgets).
CRD_RULES: tuple[Exclusive | AtMost, ...] = (
    AtMost("max_num_seqs", "max_num_batched_tokens", why="every running sequence needs a token per step"),
)

MAX_LIST_ITEMS = 64  # items a list option may hold in the CRD (hosts, ...)

CRD_PATHS = {option.crd: name for name, option in OPTIONS.items() if option.crd is not None}


def leaf(name: str) -> str:
    """The CRD field name of option `name` (the last segment of its path)."""
    crd = OPTIONS[name].crd
    if crd is None:
        raise KeyError(f"{name} is not in the CRD")
    return crd.rsplit(".", 1)[-1]


class _Checked(BaseModel):
    """A model whose fields are engine options, checked against the two-option rules on its level."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)
    option_names: ClassVar[dict[str, str]] = {}  # python field -> engine option
    rules: ClassVar[tuple[Exclusive | AtMost, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> _Checked:
        values = {option: getattr(self, field) for field, option in self.option_names.items()}
        rule = broken_rule(values, self.rules)
        if rule is not None:
            raise ValueError(rule.message(leaf))
        return self


def _cel(rule: Exclusive | AtMost) -> dict[str, str]:
    if isinstance(rule, Exclusive):
        a, b = leaf(rule.first), leaf(rule.second)
        text = f"!has(self.{a}) || !has(self.{b})"
    else:
        a, b = leaf(rule.low), leaf(rule.high)
        text = f"!has(self.{a}) || !has(self.{b}) || self.{a} <= self.{b}"
    return {"rule": text, "message": rule.message(leaf)}


def _bounds_check(name: str) -> AfterValidator:
    """The engine's own check of option `name` (Option.problem), named as the CRD names it."""
    option = OPTIONS[name]

    def check(value: int | None) -> int | None:
        problem = None if value is None else option.problem(value)
        if problem is not None:
            raise ValueError(f"{leaf(name)} {problem}")
        return value

    return AfterValidator(check)


def description(name: str) -> str:
    option = OPTIONS[name]
    text = option.help[0].upper() + option.help[1:] + "."
    return text if option.vllm is not None else text + " corral engine only."


def _field(name: str, option: Option) -> tuple[Any, Any]:
    """(annotation, FieldInfo) of option `name` in the CRD."""
    extra: dict[str, Any] = {}
    annotation: Any = value_type(name)
    if is_list(name):  # `--flag A B`: an array of non-empty items
        item = Annotated[annotation, Field(min_length=1, max_length=253)]
        annotation = Annotated[list[item], Field(min_length=1, max_length=MAX_LIST_ITEMS)]  # type: ignore[valid-type]
    elif option.choices is not None:
        annotation = Literal[option.choices]  # type: ignore[valid-type]
    elif option.is_bytes:
        annotation = Annotated[str, Field(pattern=BYTES_PATTERN)]
    elif option.ge is not None or option.le is not None:
        annotation = Annotated[annotation, Field(ge=option.ge, le=option.le)]
    if option.is_power_of_two:
        message = f"{leaf(name)} must be a power of two between {option.ge} and {option.le}"
        powers = [1 << i for i in range(int(option.le or 1).bit_length())]
        extra["x-kubernetes-validations"] = [{"rule": f"self in {powers}", "message": message}]
        annotation = Annotated[annotation, _bounds_check(name)]
    if option.crd_default is None:
        annotation = annotation | None
    info = Field(default=option.crd_default, description=description(name), json_schema_extra=extra or None)
    return annotation, info


def _model(title: str, doc: str, names: list[str], extra_fields: dict[str, Any]) -> type[_Checked]:
    """A pydantic model with one field per option in `names` and the rules among them."""
    level = set(names)
    rules = tuple(rule for rule in (*RULES, *CRD_RULES) if set(rule.names) <= level)

    cel_rules: list[Any] = [_cel(r) for r in rules]

    class Base(_Checked):
        model_config = ConfigDict(
            json_schema_extra={"x-kubernetes-validations": cel_rules} if rules else None
        )
        option_names: ClassVar[dict[str, str]] = {to_snake(leaf(n)): n for n in names}

    Base.rules = rules
    fields: dict[str, Any] = {to_snake(leaf(n)): _field(n, OPTIONS[n]) for n in names} | extra_fields
    return create_model(title, __base__=Base, __doc__=doc, **fields)


def _build() -> type[_Checked]:
    groups: dict[str, list[str]] = {}
    top: list[str] = []
    for name, option in OPTIONS.items():
        if option.crd is None:
            continue
        if "." in option.crd:
            groups.setdefault(option.crd.split(".", 1)[0], []).append(name)
        else:
            top.append(name)
    nested = {
        group: (
            _model(to_camel(group).title(), GROUP_DESCRIPTIONS[group], names, {}) | None,
            Field(default=None, description=GROUP_DESCRIPTIONS[group]),
        )
        for group, names in groups.items()
    }
    doc = "Typed engine arguments; unset fields keep the engine's defaults."
    return _model("EngineArgsSpec", doc, top, nested)


EngineArgsSpec = _build()


def given_options(args: BaseModel) -> dict[str, object]:
    """The options an LLMDeployment sets, by engine option name (byte sizes as ints), in
    declaration order."""
    raw = args.model_dump(by_alias=True, exclude_none=True)
    paths: dict[str, object] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            paths |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            paths[key] = value
    given = {CRD_PATHS[path]: value for path, value in paths.items()}
    for name in given:
        if OPTIONS[name].is_bytes:
            given[name] = parse_bytes(str(given[name]))
    return {name: given[name] for name in OPTIONS if name in given}


def corral_only_fields() -> list[str]:
    """CRD fields (top-level names) of options vLLM has no equivalent for."""
    return [leaf(n) for n, o in OPTIONS.items() if o.crd is not None and o.vllm is None]
