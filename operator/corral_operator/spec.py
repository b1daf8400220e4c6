"""The LLMDeployment spec as pydantic models: the one source of the CRD schema and of validation.

Field names are camelCase on the wire (aliases) and snake_case in Python. `x-kubernetes-validations`
(CEL) rules live next to the fields they check, so the API server rejects bad specs at `kubectl apply`;
`LLMDeploymentSpec.model_validate` re-checks them in the operator, which never trusts its input.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from corral_engine import wire
from corral_engine.args import OPTIONS
from corral_engine.sources.uri import parse_model_uri
from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from corral_operator import spec_base
from corral_operator.engine_args_spec import EngineArgsSpec, corral_only_fields, given_options
from corral_operator.model_spec import AdapterSpec, ModelSpec
from corral_operator.placement import Affinity, Toleration
from corral_operator.pod_spec import PodSpecOverrides
from corral_operator.spec_base import SpecError, SpecModel, cel, validations

# The API's names are part of the wire contract (the gateway patches LLMDeployments too).
GROUP = wire.GROUP
VERSION = wire.VERSION
KIND = wire.KIND
PLURAL = wire.PLURAL
SINGULAR = "llmdeployment"
SHORT_NAMES = ("llmd",)
API_VERSION = wire.API_VERSION

EngineKind = Literal["corral", "vllm"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]

CPU_PATTERN = spec_base.CPU_PATTERN
MEMORY_PATTERN = spec_base.MEMORY_PATTERN
PERCENT_PATTERN = r"^[0-9]+%$"
INT_OR_PERCENT_MESSAGE = "must be a whole number or a percentage such as 25%"


def _corral_only_rule() -> dict[str, str]:
    fields = corral_only_fields()
    unset = " && ".join(f"!has(self.args.{f})" for f in fields)
    return cel(f"self.kind == 'corral' || !has(self.args) || ({unset})", CORRAL_ONLY_MESSAGE)


CORRAL_ONLY_MESSAGE = (
    f"args.{' and args.'.join(corral_only_fields())} are corral engine options; vllm has no equivalent"
)


class EngineSpec(SpecModel):
    """The inference engine: which one, its image and its arguments."""

    model_config = ConfigDict(json_schema_extra=validations(_corral_only_rule()))
    kind: EngineKind = Field(default="corral", description="corral (the bundled engine) or vllm.")
    image: str = Field(min_length=1, max_length=512, description="Container image of the engine.")
    image_pull_policy: PullPolicy = Field(
        default="IfNotPresent",
        description="When the kubelet pulls the engine image (core/v1 imagePullPolicy).",
    )
    port: int = Field(default=8000, ge=1024, le=65535, description="Container port of the HTTP server.")
    args: EngineArgsSpec = Field(default_factory=EngineArgsSpec)  # type: ignore[valid-type]
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=64, description="Appended verbatim to the engine's flags."
    )

    @model_validator(mode="after")
    def _check(self) -> EngineSpec:
        if self.kind == "vllm" and any(OPTIONS[n].vllm is None for n in given_options(self.args)):
            raise ValueError(CORRAL_ONLY_MESSAGE)
        return self


class ResourcesSpec(SpecModel):
    """Per-replica resources; requests equal limits (Guaranteed QoS keeps latency steady)."""

    cpu: str = Field(
        default="1",
        max_length=32,
        json_schema_extra={"pattern": CPU_PATTERN},
        description="CPU cores, above 0: e.g. 2, 1.5 or 500m.",
    )
    memory: str = Field(
        default="4Gi",
        max_length=32,
        json_schema_extra={"pattern": MEMORY_PATTERN},
        description="Memory, above 0: e.g. 16Gi or 512Mi (binary Ki, Mi, Gi, Ti; decimal k, M, G, T).",
    )

    @field_validator("cpu")
    @classmethod
    def _check_cpu(cls, value: str) -> str:
        if not re.fullmatch(CPU_PATTERN, value):
            raise ValueError(f"cpu {value!r} is not a CPU quantity above 0 such as 2, 1.5 or 500m")
        return value

    @field_validator("memory")
    @classmethod
    def _check_memory(cls, value: str) -> str:
        if not re.fullmatch(MEMORY_PATTERN, value):
            raise ValueError(
                f"memory {value!r} is not a memory quantity above 0 such as 16Gi or 512Mi "
                "(suffixes Ki, Mi, Gi, Ti, Pi, Ei or k, M, G, T, P, E; not GB)"
            )
        return value

    gpu: int = Field(default=0, ge=0, le=16, description="nvidia.com/gpu count per replica.")


AutoscalingMode = Literal["builtin", "hpa", "keda"]
HPA_ZERO_MESSAGE = "autoscaling.minReplicas 0 needs mode builtin or keda: an HPA cannot scale to zero"
KEDA_URL_MESSAGE = "autoscaling.prometheusUrl is required in keda mode (KEDA's triggers query it)"


class AutoscalingSpec(SpecModel):
    """Scale on engine load: waiting requests per replica and KV cache usage, HPA-style windows.

    mode builtin: the operator scrapes the pods and writes spec.replicas (scale subresource).
    mode hpa / keda: the operator renders a HorizontalPodAutoscaler / KEDA ScaledObject on the
    scale subresource and never writes spec.replicas (GitOps tools then see no drift).
    """

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("self.minReplicas <= self.maxReplicas", "autoscaling.minReplicas must be <= maxReplicas"),
            cel("!has(self.mode) || self.mode != 'hpa' || self.minReplicas >= 1", HPA_ZERO_MESSAGE),
            cel("!has(self.mode) || self.mode != 'keda' || has(self.prometheusUrl)", KEDA_URL_MESSAGE),
        )
    )
    mode: AutoscalingMode = Field(
        default="builtin", description="builtin (the operator scales), hpa or keda (they scale; see docs)."
    )
    prometheus_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        max_length=2048,
        description="Prometheus that scrapes the engines and the gateway (keda mode).",
    )
    min_replicas: int = Field(default=1, ge=0, le=1000, description="0 allows scale to zero.")
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Upper bound for the autoscaler.")
    target_waiting_per_replica: float = Field(
        default=4.0, gt=0, le=10000, description="Waiting requests per replica to aim for."
    )
    target_kv_usage: float = Field(default=0.8, gt=0, le=1, description="KV cache usage (0-1) to aim for.")
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600, description="Scale up only to the lowest recommendation of this window."
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="Scale down only to the highest recommendation of this window.",
    )
    scale_to_zero_idle_seconds: int = Field(
        default=600, ge=0, le=86400, description="Idle time before scaling to zero (minReplicas 0 only)."
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must be <= maxReplicas")
        if self.mode == "hpa" and self.min_replicas < 1:
            raise ValueError(HPA_ZERO_MESSAGE)
        if self.mode == "keda" and self.prometheus_url is None:
            raise ValueError(KEDA_URL_MESSAGE)
        return self

    @property
    def is_builtin(self) -> bool:
        return self.mode == "builtin"

    @property
    def can_wake(self) -> bool:
        """Whether a request brings it back from zero: the builtin autoscaler on the gateway's wake
        annotation, KEDA on the gateway's queue; an HPA does not act on a target at zero."""
        return self.mode != "hpa"


def _int_or_percent(value: object) -> object:
    """A Deployment's maxSurge / maxUnavailable: a count, or a string percentage ("5" is neither)."""
    is_count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if is_count or (isinstance(value, str) and re.fullmatch(PERCENT_PATTERN, value)):
        return value
    raise ValueError(INT_OR_PERCENT_MESSAGE)


INT_OR_PERCENT_RULE = cel(
    f"type(self) == string ? self.matches('{PERCENT_PATTERN}') : self >= 0", INT_OR_PERCENT_MESSAGE
)
IntOrPercent = Annotated[int | str, BeforeValidator(_int_or_percent)]


class RolloutSpec(SpecModel):
    """How a spec change rolls out (the Deployment's RollingUpdate strategy)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.maxSurge) || !has(self.maxUnavailable) ||"
                " !(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
                "rollout.maxSurge and rollout.maxUnavailable cannot both be 0",
            )
        )
    )
    max_surge: IntOrPercent = Field(
        default=1,
        description="Extra pods during a rollout: a count, or a percentage of replicas such as 25%.",
        json_schema_extra=validations(INT_OR_PERCENT_RULE),
    )
    max_unavailable: IntOrPercent = Field(
        default=0,
        description="Pods that may be down during a rollout: a count or a percentage such as 25%. "
        "0 (the default) keeps every serving replica until its replacement is ready.",
        json_schema_extra=validations(INT_OR_PERCENT_RULE),
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutSpec:
        if str(self.max_surge) in ("0", "0%") and str(self.max_unavailable) in ("0", "0%"):
            raise ValueError("rollout.maxSurge and rollout.maxUnavailable cannot both be 0")
        return self


FETCHER_MESSAGE = (
    "model.fetcherImage is required for hf:// and s3:// models and adapters on vllm (its image has no corral)"
)
GPU_ONLY_MESSAGE = "engine.args.gpuMemoryUtilization applies to GPU pods: set resources.gpu"
ADAPTER_NAMES_MESSAGE = "adapters must have distinct names"
ADAPTER_MODEL_NAME_MESSAGE = "adapters' names must differ from model.name and model.aliases"
MAX_ADAPTERS = 16


class LLMDeploymentSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.engine.args) || !has(self.engine.args.gpuMemoryUtilization)"
                " || (has(self.resources) && has(self.resources.gpu) && self.resources.gpu > 0)",
                GPU_ONLY_MESSAGE,
            ),
            cel(
                "self.engine.kind != 'vllm' || has(self.model.fetcherImage) ||"
                " ((!has(self.model.uri) || self.model.uri.startsWith('pvc://'))"
                " && (!has(self.adapters) || self.adapters.all(a, a.uri.startsWith('pvc://'))))",
                FETCHER_MESSAGE,
            ),
            cel(
                "!has(self.adapters) || self.adapters.all(a, a.name != self.model.name"
                " && (!has(self.model.aliases) || !(a.name in self.model.aliases)))",
                ADAPTER_MODEL_NAME_MESSAGE,
            ),
        )
    )

    model: ModelSpec
    engine: EngineSpec
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="How many engine replicas to run. With autoscaling, the autoscaler (or the HPA or "
        "KEDA) writes it, and a value outside [minReplicas, maxReplicas] is brought inside, as an HPA does.",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=64, description="Pod nodeSelector."
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Pod tolerations.")
    affinity: Affinity | None = Field(default=None, description="Pod affinity (core/v1 Affinity).")
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Scale replicas on the engines' load (waiting requests, KV cache usage). "
        "Absent: replicas is fixed.",
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    pod: PodSpecOverrides = Field(default_factory=PodSpecOverrides)
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters served beside the model, each under its own name (a request naming it "
        "generates with it); fetched before the engine starts (docs/models.md).",
        json_schema_extra=validations(
            cel("self.all(a, self.exists_one(b, b.name == a.name))", ADAPTER_NAMES_MESSAGE)
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> LLMDeploymentSpec:
        share = getattr(self.engine.args, "gpu_memory_utilization", None)  # a derived model's field
        if share is not None and not self.resources.gpu:
            raise ValueError(GPU_ONLY_MESSAGE)
        if self.engine.kind == "vllm" and self.model.fetcher_image is None and self.is_any_downloaded:
            raise ValueError(FETCHER_MESSAGE)
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(ADAPTER_NAMES_MESSAGE)
        if {self.model.name, *self.model.aliases} & set(names):
            raise ValueError(ADAPTER_MODEL_NAME_MESSAGE)
        return self

    @property
    def is_any_downloaded(self) -> bool:
        """The model or an adapter comes through the cache (so the pods get it and a fetcher)."""
        return self.model.is_downloaded or any(a.is_downloaded for a in self.adapters)

    @property
    def claims(self) -> list[str]:
        """Every PersistentVolumeClaim the engine pods mount: the model's, the cache's when an adapter
        is downloaded, and the claims pvc:// adapters are on (each once)."""
        claims = list(self.model.claims)
        if self.is_any_downloaded and self.model.cache.claim_name:
            claims.append(self.model.cache.claim_name)
        claims += [parse_model_uri(a.uri).location for a in self.adapters if not a.is_downloaded]
        return list(dict.fromkeys(claims))

    @property
    def bounded_replicas(self) -> int:
        """The replicas to run: spec.replicas brought inside [minReplicas, maxReplicas] with
        autoscaling, as an HPA bounds its target (so a value out of range never reaches the
        Deployment, whose pods would start only to be stopped at the next tick). 0 stays 0: at zero
        the autoscaler decides (a wake request, or minReplicas, brings it back)."""
        auto = self.autoscaling
        if auto is None or self.replicas == 0:
            return self.replicas
        return min(max(self.replicas, auto.min_replicas), auto.max_replicas)


def parse_spec(raw: object) -> LLMDeploymentSpec:
    """Validate a CR's spec; SpecError names the first bad field in CRD (camelCase) terms."""
    from pydantic import ValidationError

    try:
        return LLMDeploymentSpec.model_validate(raw if raw is not None else {})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        message = first["msg"].removeprefix("Value error, ")  # our validators' own words
        raise SpecError(f"spec.{where}: {message}") from e
