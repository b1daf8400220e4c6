"""What a request asks its output to match: one grammar, as plain hashable data (no llguidance).

`GrammarSpec` is the cache key of a compiled grammar; `param` names the request field it came
from, so a grammar that does not compile is a 400 naming that field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

GrammarKind = Literal["json", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)
# Any JSON object, for `response_format: {"type": "json_object"}` and `structured_outputs.json_object`.
ANY_OBJECT_SCHEMA = '{"type":"object"}'


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    # json: the schema as compact JSON text; regex, grammar: the source; choice: a JSON list.
    text: str
    # JSON only: the whitespace allowed between tokens, as a regex (None: none at all, compact JSON).
    whitespace_pattern: str | None = None
    param: str = field(default="structured_outputs", compare=False)
    # A reasoning model's chat reply: the grammar holds only after its reasoning block, which ends
    # with `reasoning_end` (None: from the first token). `reasoning_start`: the reply opens the
    # block with it, or writes no block at all; None: the reply begins inside the block.
    reasoning_end: str | None = None
    reasoning_start: str | None = None

    @staticmethod
    def json_schema(
        schema: dict[str, Any] | str, param: str, whitespace_pattern: str | None = None
    ) -> GrammarSpec:
        value = _without_no_ops(json.loads(schema) if isinstance(schema, str) else schema)
        text = json.dumps(value, separators=(",", ":"))  # key order kept: it orders the output
        return GrammarSpec("json", text, whitespace_pattern, param)

    @staticmethod
    def choice(options: list[str], param: str) -> GrammarSpec:
        return GrammarSpec("choice", json.dumps(list(options)), param=param)

    def after_reasoning(self, end: str, start: str | None) -> GrammarSpec:
        return replace(self, reasoning_end=end, reasoning_start=start)


# Where a JSON schema holds subschemas (2020-12, and draft-07's `definitions`, `additionalItems` and
# list-valued `items`): a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = frozenset(
    {"items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else"}
    | {"propertyNames", "unevaluatedItems", "unevaluatedProperties"}
)
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _without_no_ops(schema: Any) -> Any:
    """`schema` less every `"uniqueItems": false`: the default, so it constrains nothing, but
    llguidance refuses the keyword whatever its value (`true` stays, and is refused: 400)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "uniqueItems" and value is False:
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: _without_no_ops(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [_without_no_ops(sub) for sub in value]
        elif key in _SUBSCHEMA:
            value = _without_no_ops(value)
        out[key] = value
    return out
