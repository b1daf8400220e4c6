"""Request fields for tool calling: `tools`, `tool_choice`, `parallel_tool_calls`, and what they
ask of generation (a grammar for "required" and a named function; a parser for "auto")."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corral_engine.errors import InvalidRequestError
from corral_engine.server.tool_parsers import (
    CALL_IDS,
    MARKER_TOKENS,
    TOOL_PARSERS,
    FirstCallOnly,
    RequiredListParser,
    ToolParser,
    default_call_id,
)
from corral_engine.structured.spec import GrammarSpec

# OpenAI: "omitting parameters defines a function with an empty parameter list", so a forced
# call of such a function is `{}`, not whatever object the model makes up.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar enforces `parameters` either way


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Strict):
    """Calls limited to some of `tools`, which the request still renders (so prompts stay the same
    and cached whichever tools a turn allows)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCallItem(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolPlan:
    """How a request's reply becomes tool calls: `grammar` (required, named) constrains it,
    `make_parser` makes the reader of each choice's calls (None: no tool calls, plain content);
    `named` is the forced function; `new_call_id` makes each call's id (in the form the model's
    template accepts back); `markers`: special tokens the parser reads, which the reply's text
    must show."""

    def __init__(
        self,
        grammar: GrammarSpec | None,
        make_parser: Callable[[], ToolParser] | None,
        named: str | None = None,
        new_call_id: Callable[[], str] = default_call_id,
        markers: tuple[str, ...] = (),
    ) -> None:
        self.grammar = grammar
        self.make_parser = make_parser
        self.named = named
        self.new_call_id = new_call_id
        self.markers = markers


NO_TOOLS = ToolPlan(None, None)


def plan_tools(
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool,
    parser_name: str | None,
) -> ToolPlan:
    """The plan for these fields; InvalidRequestError for a choice the request cannot have."""
    if choice is not None and choice != "none" and not tools:
        raise InvalidRequestError("tool_choice needs tools", "tool_choice")
    by_name = _by_name(tools or [])
    if not tools or choice == "none":
        return NO_TOOLS
    new_call_id = CALL_IDS.get(parser_name or "", default_call_id)
    if isinstance(choice, AllowedToolsChoice):
        by_name = {name: by_name[name] for name in allowed_names(choice, by_name)}
        choice = choice.allowed_tools.mode
    if isinstance(choice, NamedToolChoice):
        fn = by_name.get(choice.function.name)
        if fn is None:
            raise InvalidRequestError(
                f"tool_choice names `{choice.function.name}`, which is not in tools", "tool_choice"
            )
        grammar = GrammarSpec.json_schema(fn.parameters or NO_PARAMETERS, f"tools.{fn.name}.parameters")
        return ToolPlan(grammar, None, fn.name, new_call_id)
    if choice == "required":
        schema = _required_schema(list(by_name.values()), parallel)
        return ToolPlan(GrammarSpec.json_schema(schema, "tools"), RequiredListParser, None, new_call_id)
    if parser_name is None:  # "auto", given or by default
        raise InvalidRequestError(
            '"auto" tool choice needs the server to be started with --tool-call-parser', "tool_choice"
        )
    parser = TOOL_PARSERS[parser_name]
    functions = {name: fn.parameters for name, fn in by_name.items()}
    markers = MARKER_TOKENS.get(parser_name, ())
    if not parallel:
        return ToolPlan(None, lambda: FirstCallOnly(parser(functions)), None, new_call_id, markers)
    return ToolPlan(None, lambda: parser(functions), None, new_call_id, markers)


def _by_name(tools: list[Tool]) -> dict[str, FunctionDef]:
    """The functions by name; two tools of one name are a 400 (which would a call mean?)."""
    by_name: dict[str, FunctionDef] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in by_name:
            raise InvalidRequestError(f"tools[{i}] repeats the function name `{name}`", "tools")
        by_name[name] = tool.function
    return by_name


def allowed_names(choice: AllowedToolsChoice, by_name: Collection[str]) -> list[str]:
    """The functions an allowed_tools choice allows, each of them in `tools` (else a 400)."""
    names = [ref.function.name for ref in choice.allowed_tools.tools]
    for name in names:
        if name not in by_name:
            raise InvalidRequestError(
                f"tool_choice.allowed_tools names `{name}`, which is not in tools", "tool_choice"
            )
    return list(dict.fromkeys(names))


def _required_schema(functions: list[FunctionDef], parallel: bool) -> dict[str, Any]:
    """A JSON array of `{"name", "parameters"}` calls, each valid for its function. Each
    function's parameters move under the array schema's `$defs`, their local references
    (`#/$defs/...` from a pydantic model, `#` for recursion) rebased to point there too."""
    defs: dict[str, Any] = {}
    items = []
    for i, fn in enumerate(functions):
        where = f"#/$defs/tool_{i}"
        defs[f"tool_{i}"] = _rebase_refs(fn.parameters or NO_PARAMETERS, where)
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn.name}, "parameters": {"$ref": where}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})  # values, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of the schema `node` whose references into itself (`#`, `#/...`) point into `base`."""
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # its keys are names, not keywords
            out[key] = {name: _rebase_refs(schema, base) for name, schema in value.items()}
        else:
            out[key] = _rebase_refs(value, base)
    return out
