"""Label and annotation keys the operator writes; those the gateway reads too come from corral_engine.wire.

Services carry the common labels (the EndpointSlice controller mirrors a Service's labels onto its
EndpointSlices), so a gateway finds a model's replicas with `corral.dev/model=<served name>`.
"""

from __future__ import annotations

from corral_engine import wire

NAME = "app.kubernetes.io/name"
INSTANCE = wire.INSTANCE_LABEL  # the gateway finds a model's LLMDeployment by it
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = wire.MANAGED_BY_LABEL
PART_OF = "app.kubernetes.io/part-of"
MODEL = wire.MODEL_LABEL  # value: model_label_value(spec.model.name)
ENGINE = "corral.dev/engine"  # value: corral | vllm

NAME_VALUE = "corral-engine"
COMPONENT_VALUE = "engine"
MANAGED_BY_VALUE = wire.MANAGED_BY_VALUE
PART_OF_VALUE = "corral"

# Annotation a gateway sets (any value, conventionally an RFC 3339 time) to wake a model at zero.
WAKE_ANNOTATION = wire.WAKE_ANNOTATION
# Annotation on Services with the LLMDeployment's name, for tools that map endpoints back to it.
OWNER_ANNOTATION = "corral.dev/llmdeployment"
FIELD_MANAGER = "corral-operator"


def selector(name: str) -> dict[str, str]:
    """Immutable Deployment selector: never includes labels the spec can change."""
    return {NAME: NAME_VALUE, INSTANCE: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def managed(name: str) -> str:
    """Label selector for every child object the operator manages for LLMDeployment `name`."""
    return f"{MANAGED_BY}={MANAGED_BY_VALUE},{INSTANCE}={name}"


def common(name: str, model: str, engine_kind: str) -> dict[str, str]:
    return {
        **selector(name),
        COMPONENT: COMPONENT_VALUE,
        MANAGED_BY: MANAGED_BY_VALUE,
        PART_OF: PART_OF_VALUE,
        MODEL: wire.model_label_value(model),
        ENGINE: engine_kind,
    }
