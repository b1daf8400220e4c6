"""What every part of the LLMDeployment spec shares: the pydantic base, CEL rule helpers, SpecError."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?$"


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
