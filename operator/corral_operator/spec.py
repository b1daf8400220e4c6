"""The LLMDeployment spec as pydantic models: the one source of the CRD schema and of validation.

Field names are camelCase on the wire (aliases) and snake_case in Python. `x-kubernetes-validations`
(CEL) rules live next to the fields they check, so the API server rejects bad specs at `kubectl apply`;
`LLMDeploymentSpec.model_validate` re-checks them in the operator, which never trusts its input.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "corral.dev"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ("llmd",)
API_VERSION = f"{GROUP}/{VERSION}"

EngineKind = Literal["corral", "vllm"]
KvPolicy = Literal["preempt", "reserve"]
DType = Literal["auto", "bfloat16", "float16", "float32"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]

MAX_BLOCK_SIZE = 1024
POWERS_OF_TWO = tuple(1 << i for i in range(11))  # 1..1024
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?$"
BYTES_PATTERN = r"^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$"
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
PERCENT_OR_INT = r"^[0-9]+%?$"


class SpecError(ValueError):
    """The spec cannot be turned into a deployment; the message says which field and why."""


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class PvcSource(_Model):
    """Weights on a PersistentVolumeClaim, mounted read-only at /models."""

    claim_name: str = Field(min_length=1, max_length=253, description="PVC in the same namespace.")
    path: str = Field(
        default="",
        max_length=1024,
        pattern=r"^[^/].*$|^$",
        description="Relative path of the checkpoint directory inside the claim ('' = the root).",
    )


class HostPathSource(_Model):
    """Weights in a directory on the node (single-node and test clusters)."""

    path: str = Field(min_length=1, max_length=1024, pattern=r"^/", description="Absolute path on the node.")


class ModelSource(_Model):
    """Where the weights are: exactly one of pvc or hostPath."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("has(self.pvc) != has(self.hostPath)", "model.source needs exactly one of pvc or hostPath")
        )
    )
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.pvc is None) == (self.host_path is None):
            raise ValueError("model.source needs exactly one of pvc or hostPath")
        return self


class ModelSpec(_Model):
    """The model: its served name and where its checkpoint (config, tokenizer, weights) lives."""

    name: str = Field(
        pattern=LABEL_VALUE_PATTERN,
        max_length=63,
        description="Served model name (the OpenAI `model`); also the pods' corral.dev/model label value.",
    )
    source: ModelSource


class SpeculativeSpec(_Model):
    """Speculative decoding: n-gram (prompt lookup) drafts verified in one step; greedy output unchanged."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.promptLookupMin) || !has(self.promptLookupMax)"
                " || self.promptLookupMin <= self.promptLookupMax",
                "speculative.promptLookupMin must be <= promptLookupMax",
            )
        )
    )
    method: Literal["ngram"] = Field(default="ngram", description="ngram: draft tokens from the prompt.")
    num_speculative_tokens: int = Field(default=4, ge=1, le=16, description="Drafts verified per step.")
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=16, description="Shortest n-gram matched.")
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=16, description="Longest n-gram matched.")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSpec:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ValueError("speculative.promptLookupMin must be <= promptLookupMax")
        return self


class EngineArgsSpec(_Model):
    """Typed engine arguments; unset fields keep the engine's defaults."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.numKvBlocks) || !has(self.kvCacheMemory)",
                "give either numKvBlocks or kvCacheMemory, not both",
            ),
            cel(
                "!has(self.maxNumSeqs) || !has(self.maxNumBatchedTokens)"
                " || self.maxNumBatchedTokens >= self.maxNumSeqs",
                "maxNumBatchedTokens must be >= maxNumSeqs (every running sequence needs a token per step)",
            ),
        )
    )
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096, description="Max running sequences.")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, le=1 << 20, description="Token budget/step."
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_BLOCK_SIZE,
        description="KV block size in tokens (a power of two).",
        json_schema_extra=validations(
            cel(f"self in {list(POWERS_OF_TWO)}", "blockSize must be a power of two between 1 and 1024")
        ),
    )
    kv_cache_memory: str | None = Field(
        default=None, pattern=BYTES_PATTERN, description="KV cache size in bytes, e.g. 4Gi."
    )
    num_kv_blocks: int | None = Field(default=None, ge=1, description="KV cache size in blocks.")
    max_model_len: int | None = Field(default=None, ge=1, description="Max prompt + output tokens.")
    kv_policy: KvPolicy | None = Field(default=None, description="corral engine only: preempt or reserve.")
    enable_prefix_caching: bool | None = Field(
        default=None, description="Reuse KV blocks of shared prefixes."
    )
    dtype: DType | None = Field(default=None, description="Weights and activations dtype.")
    max_waiting: int | None = Field(default=None, ge=0, description="corral engine only: queue bound.")
    speculative: SpeculativeSpec | None = Field(default=None, description="Off unless given.")

    @model_validator(mode="after")
    def _check(self) -> EngineArgsSpec:
        if self.block_size is not None and self.block_size not in POWERS_OF_TWO:
            raise ValueError("blockSize must be a power of two between 1 and 1024")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give either numKvBlocks or kvCacheMemory, not both")
        if (
            self.max_num_seqs is not None
            and self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise ValueError("maxNumBatchedTokens must be >= maxNumSeqs")
        return self


class EngineSpec(_Model):
    """The inference engine: which one, its image and its arguments."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.kind == 'corral' || !has(self.args) ||"
                " (!has(self.args.kvPolicy) && !has(self.args.maxWaiting))",
                "args.kvPolicy and args.maxWaiting are corral engine options; vllm has no equivalent",
            )
        )
    )
    kind: EngineKind = Field(default="corral", description="corral (the bundled engine) or vllm.")
    image: str = Field(min_length=1, max_length=512, description="Container image of the engine.")
    image_pull_policy: PullPolicy = "IfNotPresent"
    port: int = Field(default=8000, ge=1024, le=65535, description="Container port of the HTTP server.")
    args: EngineArgsSpec = Field(default_factory=EngineArgsSpec)
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=64, description="Appended verbatim to the engine's flags."
    )

    @model_validator(mode="after")
    def _check(self) -> EngineSpec:
        if self.kind == "vllm" and (self.args.kv_policy is not None or self.args.max_waiting is not None):
            raise ValueError("args.kvPolicy and args.maxWaiting are corral engine options")
        return self


class ResourcesSpec(_Model):
    """Per-replica resources; requests equal limits (Guaranteed QoS keeps latency steady)."""

    cpu: str = Field(default="1", pattern=QUANTITY_PATTERN, description="CPU cores, e.g. 2 or 500m.")
    memory: str = Field(default="4Gi", pattern=QUANTITY_PATTERN, description="Memory, e.g. 16Gi.")
    gpu: int = Field(default=0, ge=0, le=16, description="nvidia.com/gpu count per replica.")


class Toleration(_Model):
    """A core/v1 Toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class AutoscalingSpec(_Model):
    """Scale on engine load: waiting requests per replica and KV cache usage, HPA-style windows."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("self.minReplicas <= self.maxReplicas", "autoscaling.minReplicas must be <= maxReplicas"),
        )
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
        return self


IntOrPercent = int | Annotated[str, Field(pattern=PERCENT_OR_INT)]


class RolloutSpec(_Model):
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
    max_surge: IntOrPercent = Field(default=1, description="Extra pods during a rollout (count or %).")
    max_unavailable: IntOrPercent = Field(default=0, description="Pods that may be down in a rollout.")

    @model_validator(mode="after")
    def _check(self) -> RolloutSpec:
        if str(self.max_surge) in ("0", "0%") and str(self.max_unavailable) in ("0", "0%"):
            raise ValueError("rollout.maxSurge and rollout.maxUnavailable cannot both be 0")
        return self


RESERVED_LABEL_RULE = cel(
    "self.all(k, !k.startsWith('app.kubernetes.io/') && !k.startsWith('corral.dev/'))",
    "pod.labels may not set app.kubernetes.io/* or corral.dev/* keys; the operator owns them",
)
OPEN_OBJECT: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class EnvVar(_Model):
    """A core/v1 EnvVar."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(default=None, json_schema_extra=OPEN_OBJECT)


class PodSpecOverrides(_Model):
    """Additions to the engine pods."""

    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables."
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
        description="Extra pod labels (not app.kubernetes.io/* or corral.dev/*).",
        json_schema_extra=validations(RESERVED_LABEL_RULE),
    )
    service_account_name: str | None = Field(default=None, max_length=253)
    priority_class_name: str | None = Field(default=None, max_length=253)

    @model_validator(mode="after")
    def _check(self) -> PodSpecOverrides:
        for key in self.labels:
            if key.startswith(("app.kubernetes.io/", "corral.dev/")):
                raise ValueError(f"pod.labels may not set {key}; the operator owns that key")
        return self


class LLMDeploymentSpec(_Model):
    model: ModelSpec
    engine: EngineSpec
    replicas: int = Field(default=1, ge=0, le=1000, description="Written by the autoscaler when enabled.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=64, description="Pod nodeSelector."
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Pod tolerations.")
    affinity: dict[str, Any] | None = Field(
        default=None, description="Pod affinity (core/v1 Affinity).", json_schema_extra=OPEN_OBJECT
    )
    autoscaling: AutoscalingSpec | None = Field(default=None, description="Absent: replicas is fixed.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    pod: PodSpecOverrides = Field(default_factory=PodSpecOverrides)


def parse_spec(raw: object) -> LLMDeploymentSpec:
    """Validate a CR's spec; SpecError names the first bad field in CRD (camelCase) terms."""
    from pydantic import ValidationError

    try:
        return LLMDeploymentSpec.model_validate(raw if raw is not None else {})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        raise SpecError(f"spec.{where}: {first['msg']}") from e


class Condition(_Model):
    type: Literal["Available", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=128)
    message: str = Field(default="", max_length=4096)
    last_transition_time: str | None = None
    observed_generation: int | None = None


class LoadStatus(_Model):
    kv_usage_percent: int | None = Field(default=None, description="Mean KV cache usage of ready replicas.")
    num_requests_waiting: int | None = Field(default=None, description="Waiting requests, all replicas.")
    num_requests_running: int | None = None
    observed_at: str | None = None


class LLMDeploymentStatus(_Model):
    observed_generation: int | None = None
    replicas: int | None = None
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(default=None, description="In-cluster URL of the Service.")
    conditions: list[Condition] = Field(default_factory=list)
    load: LoadStatus | None = None
    last_scale_time: str | None = None
    last_active_time: str | None = Field(default=None, description="Last time a replica had work.")
