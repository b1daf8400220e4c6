"""Gateway settings: built once at the edge (config file, environment, CLI flags) and never mutated."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from corral_engine import wire
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PolicyName = Literal["prefix-affinity", "kv-aware", "least-requests", "round-robin", "llm-d"]
# A namespace's name is a DNS label (RFC 1123).
NamespaceName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]


class KubernetesDiscovery(BaseModel):
    """Watch EndpointSlices selected by label; each ready endpoint is one replica."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    # endpointslices: the operator's Services (standard). pods: ready Pods directly (for clusters
    # whose pod IPs EndpointSlices cannot carry, such as the loopback pod IPs of the e2e cluster).
    source: Literal["endpointslices", "pods"] = "endpointslices"
    # One watch per namespace (a Role in each will do); empty: every namespace (needs a ClusterRole).
    # `namespace: NS`, the older one-namespace form, is read as `namespaces: [NS]`.
    namespaces: tuple[NamespaceName, ...] = ()
    # The operator labels the Services (and so their EndpointSlices) and Pods it manages with these.
    label_selector: str = wire.MANAGED_SELECTOR
    model_label: str = wire.MODEL_LABEL  # label carrying the model name where no LLMDeployment says it
    # Read served names and aliases from the LLMDeployments (needs RBAC to list and watch them);
    # without it, or when refused, each pool is named by its objects' model label.
    read_llmdeployments: bool = True
    port_name: str | None = "http"  # falls back to the slice's first port when absent
    kubeconfig: Path | None = None  # None: in-cluster config, else this kubeconfig file
    watch_timeout_s: int = Field(default=30, ge=1)
    # Scale from zero: annotate the LLMDeployment of a model with no replica (needs RBAC to patch
    # llmdeployments), and let its requests wait up to wake_timeout_s for one to appear. Only one
    # whose autoscaling scales from zero (builtin or keda mode); others get queue_timeout_s.
    wake_from_zero: bool = True
    wake_timeout_s: float = Field(default=300.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _one_namespace(cls, data: Any) -> Any:
        """The older `namespace: NS` (None or "": every namespace) as `namespaces: [NS]`."""
        if not isinstance(data, dict) or "namespace" not in data:
            return data
        data = dict(data)
        one = data.pop("namespace")
        if one and data.get("namespaces"):
            raise ValueError("set kubernetes.namespaces only: namespace is its older one-namespace form")
        if one:
            data["namespaces"] = [one]
        return data

    @field_validator("namespaces")
    @classmethod
    def _distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(value))  # one watch per namespace, in the order given


class GatewaySettings(BaseSettings):
    """Everything the gateway needs, validated once at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="CORRAL_GATEWAY_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # model name -> replica base URLs (e.g. http://127.0.0.1:8100)
    backends: dict[str, list[str]] = Field(default_factory=dict)
    kubernetes: KubernetesDiscovery = Field(default_factory=KubernetesDiscovery)
    policy: PolicyName = "prefix-affinity"
    api_keys_file: Path | None = None
    # Sent to engines as `Authorization: Bearer ...` when they require a key of their own.
    upstream_api_key: str | None = None
    # One log line per request (id, model, replica, status, tokens, latency; never prompts or keys).
    access_log: bool = True
    # /metrics answers only a key of api_keys_file (Prometheus sends one): it names the models,
    # the keys and the replicas' addresses, and an Ingress or HTTPRoute reaches every path.
    metrics_require_auth: bool = False

    # Admission: per-model queue used while every replica of the model is saturated.
    max_queue_len: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    # Saturation, as in the Gateway API Inference Extension: queue > 5 or KV > 0.8.
    saturation_max_waiting: int = Field(default=5, ge=0)
    saturation_max_kv_usage_ratio: float = Field(default=0.8, gt=0, le=1)

    # Prefix affinity: hash of the prompt's leading blocks of characters.
    affinity_block_chars: int = Field(default=64, ge=1)
    affinity_num_blocks: int = Field(default=4, ge=1)
    affinity_load_factor: float = Field(default=1.25, ge=1.0)  # bounded-load consistent hashing c
    affinity_vnodes: int = Field(default=64, ge=1)
    # Prefix affinity prices the wait for a replica's steps (the rest of the step in flight and one
    # more, seen from its streams' chunk times) at this many prompt blocks a second; 0: left out.
    affinity_step_blocks_per_s: float = Field(default=1500.0, ge=0.0)  # policies.STEP_WAIT_BLOCKS_PER_S
    # ... and counts a prompt's own uncached blocks this many times more for each request sent to a
    # replica since its step in flight began (they start with the prompt's step); 0: left out.
    affinity_queued_block_weight: float = Field(default=1.0, ge=0.0)  # policies.QUEUED_BLOCK_WEIGHT
    # Prefix index (prefix-affinity, llm-d): up to this many chained blocks of `affinity_block_chars`.
    affinity_chain_blocks: int = Field(default=256, ge=1)

    # Load tracking.
    poll_interval_s: float = Field(default=0.075, gt=0)
    load_max_age_s: float = Field(default=2.0, gt=0)

    # Resilience.
    # Envoy's default. A connect the kernel completed at once still times out when the gateway's
    # own loop stalls past it (a burst on a saturated machine: 0.5-5 s measured); such a timeout
    # is retried but is not the replica's failure (`loop_lag.py`).
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # For a stream: its first event (the replica's queue and the prompt's prefill), and any pause
    # between two chunks after it. A non-streamed answer comes whole once generated: its wait is
    # response_timeout_s (None: no limit).
    first_byte_timeout_s: float = Field(default=300.0, gt=0)
    response_timeout_s: float | None = Field(default=3600.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    eject_after_failures: int = Field(default=3, ge=1)
    ejection_s: float = Field(default=2.0, gt=0)
    max_ejection_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=2048, ge=1)
    max_request_bytes: int = Field(default=wire.MAX_REQUEST_BODY_BYTES, ge=1024)  # the engine's own limit
    # On SIGTERM: open requests get this long to finish, then end with a 503 `draining` error (a
    # stream: an error event). The chart keeps preStop sleep + this below the pod's grace period.
    drain_timeout_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _metrics_key_source(self) -> GatewaySettings:
        if self.metrics_require_auth and self.api_keys_file is None:
            raise ValueError("metrics_require_auth needs api_keys_file: the keys /metrics accepts")
        return self

    @field_validator("backends")
    @classmethod
    def _check_backends(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for model, urls in value.items():
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(
                        f"backend {url!r} for model {model!r} must start with http:// or https://"
                    )
        return {m: [u.rstrip("/") for u in urls] for m, urls in value.items()}


def parse_backend_flag(flag: str) -> tuple[str, str]:
    """`MODEL=URL` -> (model, url); raises ValueError with a readable message."""
    model, sep, url = flag.partition("=")
    if not sep or not model.strip() or not url.strip():
        raise ValueError(f"--backend expects MODEL=URL, got {flag!r}")
    return model.strip(), url.strip()


def load_settings(
    config_file: Path | None = None,
    overrides: dict[str, Any] | None = None,
    backend_flags: Sequence[str] = (),
) -> GatewaySettings:
    """Merge the YAML config file, then explicit overrides (CLI flags), into one settings object."""
    data: dict[str, Any] = {}
    if config_file is not None:
        loaded = yaml.safe_load(config_file.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_file}: expected a mapping at the top level")
        data.update(loaded)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}  # `--kubernetes` turns discovery on, keeping the file's
        elif value is not None:
            data[key] = value
    if backend_flags:
        backends: dict[str, list[str]] = {m: list(u) for m, u in dict(data.get("backends") or {}).items()}
        for flag in backend_flags:
            model, url = parse_backend_flag(flag)
            backends.setdefault(model, []).append(url)
        data["backends"] = backends
    return GatewaySettings(**data)
