"""Request fields that constrain the output: OpenAI's `response_format` and vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object), turned into one GrammarSpec."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from corral_engine.errors import InvalidRequestError
from corral_engine.structured.spec import ANY_OBJECT_SCHEMA, GrammarSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # The grammar enforces the schema either way; strict only matters to OpenAI's own checks.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        if self.type == "structural_tag":
            raise ValueError("response_format of type structural_tag is not supported")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra field: exactly one of json, regex, choice, grammar,
    json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    # JSON is always compact here (bounded whitespace), which is what this asks for.
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # one backend, never a fallback: nothing to disable
    disable_additional_properties: bool = False
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
            )
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs.disable_additional_properties is not supported")
        return self

    def spec(self) -> GrammarSpec:
        param = "structured_outputs"
        if self.json_ is not None:
            return _json_spec(self.json_, f"{param}.json", self.whitespace_pattern)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex, param=f"{param}.regex")
        if self.choice is not None:
            return GrammarSpec.choice(self.choice, f"{param}.choice")
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar, param=f"{param}.grammar")
        return GrammarSpec("json", ANY_OBJECT_SCHEMA, self.whitespace_pattern, f"{param}.json_object")


def _json_spec(schema: dict[str, Any] | str, param: str, whitespace: str | None = None) -> GrammarSpec:
    try:
        return GrammarSpec.json_schema(schema, param, whitespace)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"Invalid JSON schema: not JSON ({e})", param) from e
    except TypeError as e:  # a JSON document that is not a schema object
        raise InvalidRequestError(f"Invalid JSON schema: {e}", param) from e


def grammar_of(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> GrammarSpec | None:
    """The request's one output constraint, or None; InvalidRequestError when it asks for two."""
    fmt = None
    if response_format is not None and response_format.type == "json_object":
        fmt = GrammarSpec("json", ANY_OBJECT_SCHEMA, param="response_format")
    elif response_format is not None and response_format.json_schema is not None:
        schema = response_format.json_schema.schema_ or {}
        fmt = _json_spec(schema, "response_format.json_schema.schema")
    if fmt is not None and structured is not None:
        raise InvalidRequestError(
            "Give either response_format or structured_outputs, not both.", "structured_outputs"
        )
    return fmt if structured is None else structured.spec()
