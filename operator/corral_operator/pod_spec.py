"""`spec.pod`: the escape hatches into the engine pods (KServe's pod-template overlay, as typed fields).

Everything here is added to or merged over what the operator renders; the operator's own labels,
ports, probes' paths and the model volume stay its own.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from corral_operator.spec_base import SpecModel, cel, validations

RESERVED_LABEL_RULE = cel(
    "self.all(k, !k.startsWith('app.kubernetes.io/') && !k.startsWith('corral.dev/'))",
    "pod.labels may not set app.kubernetes.io/* or corral.dev/* keys; the operator owns them",
)
OPEN_OBJECT: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class EnvVar(SpecModel):
    """A core/v1 EnvVar."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(default=None, json_schema_extra=OPEN_OBJECT)


class ProbeTiming(SpecModel):
    """Timings of one probe (the path and port stay the operator's: GET /health on the engine port)."""

    initial_delay_seconds: int | None = Field(default=None, ge=0, le=3600)
    period_seconds: int | None = Field(default=None, ge=1, le=3600)
    timeout_seconds: int | None = Field(default=None, ge=1, le=3600)
    failure_threshold: int | None = Field(default=None, ge=1, le=10000)


class Probes(SpecModel):
    """Override the engine probes' timings; e.g. a larger startup failureThreshold for huge models."""

    startup: ProbeTiming | None = None
    readiness: ProbeTiming | None = None
    liveness: ProbeTiming | None = None


class PodSpecOverrides(SpecModel):
    """Additions to the engine pods."""

    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables."
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=32,
        description="Environment from ConfigMaps or Secrets (core/v1 EnvFromSource).",
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=64, description="Extra pod volumes (core/v1 Volume)."
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, max_length=64, description="Extra engine volumeMounts (core/v1 VolumeMount)."
    )
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64, description="Pod annotations.")
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod labels (not app.kubernetes.io/* or corral.dev/*), e.g. for a service mesh.",
        json_schema_extra=validations(RESERVED_LABEL_RULE),
    )
    service_account_name: str | None = Field(default=None, max_length=253)
    priority_class_name: str | None = Field(default=None, max_length=253)
    image_pull_secrets: list[str] = Field(
        default_factory=list, max_length=16, description="Names of Secrets for pulling the engine image."
    )
    runtime_class_name: str | None = Field(
        default=None,
        max_length=253,
        description="RuntimeClass, e.g. nvidia where the GPU runtime is not default.",
    )
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=16,
        description="core/v1 TopologySpreadConstraints; without a labelSelector, this deployment's pods.",
    )
    security_context: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys merged over the pod securityContext (runAsUser 10001, non-root, RuntimeDefault).",
        json_schema_extra=OPEN_OBJECT,
    )
    container_security_context: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys merged over the engine container's securityContext (read-only root, no caps).",
        json_schema_extra=OPEN_OBJECT,
    )
    probes: Probes = Field(default_factory=Probes, description="Probe timings.")
    shm_size: str | None = Field(
        default=None,
        pattern=r"^([0-9]+(\.[0-9]+)?)(k|Ki|M|Mi|G|Gi|T|Ti)?$",
        description="Size limit of the memory-backed /dev/shm (counts against the memory limit). GPU and "
        "vLLM pods always get one, bounded by the pod's memory when unset; others only when set.",
    )

    @model_validator(mode="after")
    def _check(self) -> PodSpecOverrides:
        for key in self.labels:
            if key.startswith(("app.kubernetes.io/", "corral.dev/")):
                raise ValueError(f"pod.labels may not set {key}; the operator owns that key")
        return self
