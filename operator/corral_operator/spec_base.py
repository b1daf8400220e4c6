"""What every part of the LLMDeployment spec shares: the pydantic base, CEL rule helpers, SpecError."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# Above zero (a container with a zero request or limit is not Guaranteed, and no engine runs in it),
# written without lookaheads: the API server checks patterns with Go's regexp.
_POSITIVE = r"([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)"
CPU_PATTERN = rf"^{_POSITIVE}m?$"  # cores, or millicores with m
MEMORY_PATTERN = rf"^{_POSITIVE}(k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"  # bytes (no m: millibytes)


class SpecError(ValueError):
    """The spec cannot be turned into a deployment; the message says which field and why."""


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class SpecModel(BaseModel):
    """camelCase on the wire, unknown fields refused, immutable once parsed."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)
