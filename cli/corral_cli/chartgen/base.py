"""Base models of the chart's values: camelCase keys as in values.yaml, unknown keys refused, and
Kubernetes fragments that leave their unset fields out."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer
from pydantic.alias_generators import to_camel


class ValuesModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Fragment(ValuesModel):
    """A piece of a Kubernetes object the chart renders as given (toYaml). Its optional fields default
    to None, meaning unset: they are left out of the dump (values.yaml holds only what is set), as
    Helm leaves out a key a user sets to null."""

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}
