"""`spec.pod`: the escape hatches into the engine pods (KServe's pod-template overlay, as typed fields).

Everything here is added to or merged over what the operator renders; the operator's own labels,
ports, probes' paths and the model volume stay its own.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from corral_operator.placement import TopologySpreadConstraint
from corral_operator.spec_base import SpecModel, cel, validations

RESERVED_LABEL_RULE = cel(
    "self.all(k, !k.startsWith('app.kubernetes.io/') && !k.startsWith('corral.dev/'))",
    "pod.labels may not set app.kubernetes.io/* or corral.dev/* keys; the operator owns them",
)
OPEN_OBJECT: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

# The operator's own pod volumes and engine mount paths (render.py, model_volumes.py; a test checks
# these lists cover what they render). A user's volume or mount may not take them: the Deployment's
# lists are keyed by them, so a clash would be a duplicate the API server refuses.
RESERVED_VOLUME_NAMES = ("model", "model-cache", "tmp", "dshm")
RESERVED_VOLUME_PREFIX = "adapters-"  # the claims of pvc:// adapters: adapters-0, adapters-1, ...
RESERVED_MOUNT_PATHS = ("/models", "/models-cache", "/tmp", "/dev/shm")


def _quoted(names: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


VOLUME_NAMES_MESSAGE = (
    f"pod.volumes may not use the names {', '.join(RESERVED_VOLUME_NAMES)} or {RESERVED_VOLUME_PREFIX}*,"
    " which the operator's own volumes have"
)
MOUNT_PATHS_MESSAGE = (
    f"pod.volumeMounts may not use the paths {', '.join(RESERVED_MOUNT_PATHS)}, where the operator's"
    " own mounts are"
)


def _keyed_open_object(key: str, description: str) -> dict[str, Any]:
    """An open core/v1 object whose `key` (and `name`) the schema declares, so CEL can read them."""
    what = {"name": "Its name.", "mountPath": "Where the engine container sees it."}
    props = {
        k: {"type": "string", "description": what[k], "minLength": 1} for k in dict.fromkeys(("name", key))
    }
    return {**OPEN_OBJECT, "description": description, "required": list(props), "properties": props}


def _list_map(key: str, *rules: dict[str, str]) -> dict[str, Any]:
    """A list keyed by `key`: the API server refuses two items with the same key, as the pod's does."""
    out: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}
    return out | (validations(*rules) if rules else {})


Volume = Annotated[dict[str, Any], Field(json_schema_extra=_keyed_open_object("name", "A core/v1 Volume."))]
VolumeMount = Annotated[
    dict[str, Any], Field(json_schema_extra=_keyed_open_object("mountPath", "A core/v1 VolumeMount."))
]


class EnvVar(SpecModel):
    """A core/v1 EnvVar."""

    name: str = Field(min_length=1, max_length=256, description="The variable's name.")
    value: str | None = Field(default=None, description="Its value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="Where the value comes from instead (core/v1 EnvVarSource: secretKeyRef, ...).",
        json_schema_extra=OPEN_OBJECT,
    )


class SourceRef(SpecModel):
    """A ConfigMap or Secret in the LLMDeployment's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Its name.")
    optional: bool | None = Field(default=None, description="Start the pod even when it is missing.")


class EnvFromSource(SpecModel):
    """A core/v1 EnvFromSource: every key of a ConfigMap or a Secret as a variable."""

    prefix: str | None = Field(default=None, max_length=256, description="Prepended to every key.")
    config_map_ref: SourceRef | None = Field(default=None, description="The ConfigMap to read.")
    secret_ref: SourceRef | None = Field(default=None, description="The Secret to read.")


class ProbeTiming(SpecModel):
    """Timings of one probe (the path and port stay the operator's: GET /health on the engine port)."""

    initial_delay_seconds: int | None = Field(
        default=None, ge=0, le=3600, description="Seconds after the container starts before the first probe."
    )
    period_seconds: int | None = Field(default=None, ge=1, le=3600, description="Seconds between probes.")
    timeout_seconds: int | None = Field(
        default=None, ge=1, le=3600, description="Seconds a probe may take before it counts as failed."
    )
    failure_threshold: int | None = Field(
        default=None, ge=1, le=10000, description="Failures in a row before the probe gives up."
    )


class Probes(SpecModel):
    """Override the engine probes' timings; e.g. a larger startup failureThreshold for huge models."""

    startup: ProbeTiming | None = Field(
        default=None, description="Holds the others off while the model loads (default: 30 minutes)."
    )
    readiness: ProbeTiming | None = Field(default=None, description="When a replica takes traffic.")
    liveness: ProbeTiming | None = Field(default=None, description="When a replica is restarted.")


class PodSpecOverrides(SpecModel):
    """Additions to the engine pods."""

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment variables (one per name; they override the operator's own).",
        json_schema_extra=_list_map("name"),
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        max_length=32,
        description="Environment from ConfigMaps or Secrets (core/v1 EnvFromSource).",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=64,
        description="Extra pod volumes (core/v1 Volume; not named "
        f"{', '.join(RESERVED_VOLUME_NAMES)} or {RESERVED_VOLUME_PREFIX}*: the operator's own).",
        json_schema_extra=_list_map(
            "name",
            cel(
                f"self.all(v, !(v.name in {_quoted(RESERVED_VOLUME_NAMES)})"
                f" && !v.name.startsWith('{RESERVED_VOLUME_PREFIX}'))",
                VOLUME_NAMES_MESSAGE,
            ),
        ),
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=64,
        description="Extra engine volumeMounts (core/v1 VolumeMount; not at "
        f"{', '.join(RESERVED_MOUNT_PATHS)}: the operator's own).",
        json_schema_extra=_list_map(
            "mountPath",
            cel(f"self.all(m, !(m.mountPath in {_quoted(RESERVED_MOUNT_PATHS)}))", MOUNT_PATHS_MESSAGE),
        ),
    )
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64, description="Pod annotations.")
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod labels (not app.kubernetes.io/* or corral.dev/*), e.g. for a service mesh.",
        json_schema_extra=validations(RESERVED_LABEL_RULE),
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        description="ServiceAccount of the engine pods (its token is not mounted).",
    )
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="PriorityClass of the engine pods."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, max_length=16, description="Names of Secrets for pulling the engine image."
    )
    runtime_class_name: str | None = Field(
        default=None,
        max_length=253,
        description="RuntimeClass, e.g. nvidia where the GPU runtime is not default.",
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
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
        _check_keys("pod.env", [e.name for e in self.env], ())
        volumes = [v.get("name") for v in self.volumes]
        _check_keys("pod.volumes", volumes, RESERVED_VOLUME_NAMES, prefix=RESERVED_VOLUME_PREFIX)
        mounts = [m.get("mountPath") for m in self.volume_mounts]
        _check_keys("pod.volumeMounts", mounts, RESERVED_MOUNT_PATHS, key="mountPath")
        if any(not isinstance(m.get("name"), str) or not m["name"] for m in self.volume_mounts):
            raise ValueError("pod.volumeMounts: every mount needs a name")
        return self


def _check_keys(
    where: str, keys: list[Any], reserved: tuple[str, ...], key: str = "name", prefix: str | None = None
) -> None:
    """Every item has its key, no two share it, and none takes one the operator reserves (one of
    `reserved`, or one starting with `prefix`)."""
    if any(not isinstance(k, str) or not k for k in keys):
        raise ValueError(f"{where}: every item needs a {key}")
    if dup := next((k for i, k in enumerate(keys) if k in keys[:i]), None):
        raise ValueError(f"{where}: Duplicate value: two items have {key} {dup}")  # the API server's words
    clash = sorted({k for k in keys if k in reserved or (prefix is not None and k.startswith(prefix))})
    if clash:
        message = VOLUME_NAMES_MESSAGE if key == "name" else MOUNT_PATHS_MESSAGE
        raise ValueError(f"{message} ({', '.join(clash)})")
