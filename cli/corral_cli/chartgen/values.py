"""The chart's values as a pydantic model; values.schema.json is generated from it.

Helm validates every install and upgrade against the schema, so a typo'd key or a bad value fails
`helm install` with the field's path instead of rendering a broken manifest. Keys are camelCase, as
in values.yaml; unknown keys are refused except in the free-form Kubernetes fragments.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from corral_gateway.settings import GatewaySettings, NamespaceName, PolicyName
from pydantic import ConfigDict, Field, create_model

from corral_cli.chartgen.base import ValuesModel as _Values
from corral_cli.chartgen.exposure import HTTPRoute, Ingress, Service
from corral_cli.chartgen.pods import (
    ContainerSecurityContext,
    EnvVar,
    PodSecurityContext,
    TopologySpreadConstraint,
)

# docs/operations.md in the project's repository; a fork or a mirror sets alerts.runbookBaseUrl.
RUNBOOK_BASE_URL = "https://github.com/corral-dev/corral/blob/main/docs/operations.md"

# Settings the chart writes from its own values (the container port its probes use, discovery that
# matches its RBAC, the mounted key file, a secret from a Secret rather than the ConfigMap, the
# drain that fits the pod's grace period):
# gateway.config may not override them.
CHART_OWNED_GATEWAY_SETTINGS = frozenset(
    {"host", "port", "kubernetes", "api_keys_file", "policy", "upstream_api_key", "drain_timeout_s"}
)


def _gateway_config_schema() -> dict[str, Any]:
    """gateway.config's schema: GatewaySettings' own fields but the chart's, no others, so a typo'd
    key fails `helm install` rather than crash-looping the gateway (its settings forbid extras)."""
    fields: dict[str, Any] = {
        name: (info.annotation, info)
        for name, info in GatewaySettings.model_fields.items()
        if name not in CHART_OWNED_GATEWAY_SETTINGS
    }
    model = create_model("GatewayConfig", __config__=ConfigDict(extra="forbid"), **fields)
    schema = _strip_titles(model.model_json_schema())
    return {"additionalProperties": False, "properties": schema["properties"]}


class Image(_Values):
    repository: str = Field(min_length=1, description="Image name under image.registry.")
    tag: str = Field(default="", description="Tag; empty means the chart's appVersion.")


class GlobalImage(_Values):
    registry: str = Field(default="ghcr.io/corral-dev", description="Registry and path prefix.")
    tag: str = Field(default="", description="Default tag for every image; empty means appVersion.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ServiceAccount(_Values):
    create: bool = True
    name: str = Field(default="", description="Empty: the release's fullname plus the component.")
    annotations: dict[str, str] = Field(default_factory=dict)


class PodPlacement(_Values):
    """Scheduling, security and pod metadata shared by the operator and the gateway."""

    resources: dict[str, Any] = Field(default_factory=dict, description="Container resources.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list,
        description="Without a labelSelector, a constraint counts this component's pods.",
    )
    priority_class_name: str = Field(default="", description="Empty: the cluster's default priority.")
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    pod_labels: dict[str, str] = Field(
        default_factory=dict, description="More pod labels; the chart's own labels win over these."
    )
    pod_security_context: PodSecurityContext = Field(
        default_factory=PodSecurityContext,
        description="Null a field to unset it (e.g. runAsUser on OpenShift).",
    )
    container_security_context: ContainerSecurityContext = Field(default_factory=ContainerSecurityContext)
    extra_env: list[EnvVar] = Field(
        default_factory=list,
        description="Extra environment variables (core/v1 EnvVar), e.g. OTEL_EXPORTER_OTLP_ENDPOINT.",
    )


class Peering(_Values):
    name: str = Field(
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        max_length=63,
        description="kopf peering object shared by the replicas; empty means the release's fullname.",
    )


class Operator(PodPlacement):
    enabled: bool = True
    replicas: int = Field(default=2, ge=1, le=10, description="Replicas beyond one stand by (peering).")
    image: Image = Field(default_factory=lambda: Image(repository="corral-operator"))
    namespaces: list[NamespaceName] = Field(
        default_factory=list, description="Namespaces to serve (Roles there); empty: every namespace."
    )
    peering: Peering = Field(default_factory=Peering)
    resync_seconds: float = Field(default=15.0, gt=0, le=3600)
    scrape_networks: list[str] = Field(
        default_factory=list, description="CIDRs of engine pods the operator may scrape; empty: any."
    )
    extra_args: list[str] = Field(default_factory=list)
    service_account: ServiceAccount = Field(default_factory=ServiceAccount)
    resources: dict[str, Any] = Field(
        default_factory=lambda: {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    )


class Discovery(_Values):
    source: Literal["endpointslices", "pods"] = Field(
        default="endpointslices",
        description="Watch the operator's EndpointSlices (standard) or ready Pods directly.",
    )
    namespaces: list[NamespaceName] = Field(
        default_factory=list,
        description="Namespaces to watch (a Role in each); empty: operator.namespaces, and when that is "
        "empty too, every namespace (a ClusterRole).",
    )
    namespace: str = Field(
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        max_length=63,
        description="Deprecated: one namespace, the same as namespaces: [it].",
    )
    label_selector: str = Field(default="app.kubernetes.io/managed-by=corral-operator", min_length=1)


class ApiKeys(_Values):
    existing_secret: str = Field(
        default="", description="Secret holding the API keys file; empty: no authentication."
    )
    secret_key: str = Field(default="keys.yaml", min_length=1, description="Key of the file in the Secret.")


class UpstreamApiKey(_Values):
    existing_secret: str = Field(
        default="",
        description="Secret holding the key the gateway sends to replicas (engines started with an API "
        "key, or an OpenAI-compatible upstream); empty: send none.",
    )
    secret_key: str = Field(default="api-key", min_length=1, description="Key of the value in the Secret.")


class Autoscaling(_Values):
    enabled: bool = False
    min_replicas: int = Field(default=2, ge=1)
    max_replicas: int = Field(default=10, ge=1)
    target_cpu_utilization_percentage: int = Field(default=70, ge=1, le=100)


class DisruptionBudget(_Values):
    enabled: bool = True
    max_unavailable: int = Field(default=1, ge=1, description="Pods a voluntary disruption may take at once.")


class Gateway(PodPlacement):
    enabled: bool = True
    replicas: int = Field(default=2, ge=1, le=100)
    image: Image = Field(default_factory=lambda: Image(repository="corral-gateway"))
    container_port: int = Field(default=8000, ge=1024, le=65535)
    policy: PolicyName = "prefix-affinity"
    discovery: Discovery = Field(default_factory=Discovery)
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="More gateway settings (snake_case keys, see the gateway docs); not host, port, "
        "kubernetes, api_keys_file, policy, upstream_api_key or drain_timeout_s, which the chart sets "
        "from its own values.",
        json_schema_extra=lambda schema: schema.update(_gateway_config_schema()),
    )
    api_keys: ApiKeys = Field(default_factory=ApiKeys)
    upstream_api_key: UpstreamApiKey = Field(default_factory=UpstreamApiKey)
    service: Service = Field(default_factory=Service)
    ingress: Ingress = Field(default_factory=Ingress)
    http_route: HTTPRoute = Field(default_factory=HTTPRoute)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    pod_disruption_budget: DisruptionBudget = Field(default_factory=DisruptionBudget)
    service_account: ServiceAccount = Field(default_factory=ServiceAccount)
    resources: dict[str, Any] = Field(
        default_factory=lambda: {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    )
    pre_stop_sleep_seconds: int = Field(
        default=5,
        ge=0,
        le=120,
        description="A stopping pod keeps serving this long (a preStop sleep) while Services and "
        "load balancers stop sending to it, so a rolling update refuses no connection; 0: none.",
    )
    drain_timeout_seconds: int = Field(
        default=50,
        ge=0,
        description="After the preStop sleep, how long open requests get to finish; those still open "
        "then end with a 503 `draining` error (a stream: an error event). With the preStop sleep, "
        "below terminationGracePeriodSeconds, so they end cleanly before Kubernetes kills the pod.",
    )
    termination_grace_period_seconds: int = Field(
        default=60,
        ge=1,
        description="From SIGTERM, the preStop sleep included, to SIGKILL: above preStopSleepSeconds "
        "+ drainTimeoutSeconds.",
    )


class ScrapeApiKey(_Values):
    existing_secret: str = Field(
        default="",
        description="Secret holding a key of gateway.apiKeys the gateway's ServiceMonitor sends, for "
        "gateway.config.metrics_require_auth; empty: send none.",
    )
    secret_key: str = Field(default="api-key", min_length=1, description="Key of the API key in the Secret.")


class Monitoring(_Values):
    create: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="auto: ServiceMonitor/PodMonitor only when the cluster serves monitoring.coreos.com/v1.",
    )
    interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m|h)$")
    labels: dict[str, str] = Field(default_factory=dict)
    engines: bool = Field(
        default=False, description="Also a PodMonitor for engines (the operator makes ServiceMonitors)."
    )
    gateway_api_key: ScrapeApiKey = Field(default_factory=ScrapeApiKey)


class PeerSelector(_Values):
    namespace_selector: dict[str, Any] = Field(default_factory=dict)
    pod_selector: dict[str, Any] = Field(
        default_factory=lambda: {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    )


class NetworkPolicy(_Values):
    enabled: bool = True
    engine_namespaces: list[NamespaceName] = Field(
        default_factory=list,
        description="Namespaces running LLMDeployments; empty: operator.namespaces, else the release's.",
    )
    prometheus: PeerSelector = Field(default_factory=PeerSelector)


class Dashboards(_Values):
    enabled: bool = True
    namespace: str = Field(default="", description="Where the ConfigMaps go; empty: the release's.")
    labels: dict[str, str] = Field(default_factory=lambda: {"grafana_dashboard": "1"})
    annotations: dict[str, str] = Field(default_factory=dict)


class Alerts(_Values):
    enabled: bool = Field(
        default=True, description="A PrometheusRule with Corral's alerts (when monitoring is enabled)."
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels on the PrometheusRule, e.g. for a ruleSelector."
    )
    ttft_p99_slo_seconds: float = Field(default=2.0, gt=0, description="CorralTTFTHigh: p99 TTFT above this.")
    kv_usage_ratio: float = Field(
        default=0.9, gt=0, le=1, description="CorralKVCacheFull: KV usage above this."
    )
    error_ratio: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="CorralErrorRateHigh: share of 5xx and broken streams above this.",
    )
    queue_min_waiting: int = Field(
        default=5, ge=0, description="CorralQueueGrowing: waiting requests above this, and growing."
    )
    gc_pause_ratio: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="CorralCollectorPauses: share of a process's time in collector passes above this.",
    )
    adapter_full_ratio: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="CorralAdapterSlotsFull: share of adapter requests routed to full replicas above this.",
    )
    runbook_base_url: str = Field(
        default=RUNBOOK_BASE_URL,
        pattern=r"^https?://",
        description="Where docs/operations.md is served: each alert's runbook_url is this plus #its-name.",
    )


class TestApiKey(_Values):
    existing_secret: str = Field(
        default="", description="Secret holding one API key the gateway accepts; empty: send none."
    )
    secret_key: str = Field(default="api-key", min_length=1, description="Key of the API key in the Secret.")


class Tests(_Values):
    enabled: bool = Field(
        default=True, description="`helm test`: a pod running `corral check` on the gateway."
    )
    model: str = Field(
        default="", description="Model to send the chat completion to; empty: the first listed."
    )
    api_key: TestApiKey = Field(default_factory=TestApiKey)
    resources: dict[str, Any] = Field(
        default_factory=lambda: {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        description="The test pod's container resources.",
    )


class Values(_Values):
    # Helm hands every chart of an umbrella chart `global`, set or not: a schema without it refuses
    # Corral as a dependency. Corral reads none of it; not in values.yaml (exclude).
    global_values: dict[str, Any] = Field(
        default_factory=dict,
        alias="global",
        exclude=True,
        description="Values Helm shares across an umbrella chart's charts; Corral reads none of them.",
    )
    name_override: str = ""
    fullname_override: str = ""
    image: GlobalImage = Field(default_factory=GlobalImage)
    image_pull_secrets: list[dict[str, str]] = Field(default_factory=list)
    operator: Operator = Field(default_factory=Operator)
    gateway: Gateway = Field(default_factory=Gateway)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    dashboards: Dashboards = Field(default_factory=Dashboards)
    alerts: Alerts = Field(default_factory=Alerts)
    tests: Tests = Field(default_factory=Tests)


def _strip_titles(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_titles(v) for k, v in node.items() if k != "title"}
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def schema() -> dict[str, Any]:
    out: dict[str, Any] = _strip_titles(Values.model_json_schema(by_alias=True))
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "Corral chart values", **out}


def schema_text() -> str:
    return json.dumps(schema(), indent=2, sort_keys=False) + "\n"
