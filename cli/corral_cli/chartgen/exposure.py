"""How clients reach the gateway: its Service, and optionally an Ingress or a Gateway API HTTPRoute in
front of it (both off by default)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from corral_cli.chartgen.base import Fragment, ValuesModel

# Gateway API's Duration: up to four number-unit pairs, e.g. 1h30m or 3600s.
DURATION = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"


class Service(ValuesModel):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=80, ge=1, le=65535)
    node_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Fixed node port (type NodePort or LoadBalancer, within the cluster's node-port "
        "range); null: Kubernetes picks one.",
    )
    annotations: dict[str, str] = Field(default_factory=dict)


class IngressPath(ValuesModel):
    path: str = Field(default="/", pattern=r"^/")
    path_type: Literal["Prefix", "Exact", "ImplementationSpecific"] = "Prefix"


class IngressHost(ValuesModel):
    host: str = Field(min_length=1)
    paths: list[IngressPath] = Field(default_factory=lambda: [IngressPath()])


class IngressTLS(Fragment):
    hosts: list[str] = Field(default_factory=list)
    secret_name: str | None = Field(
        default=None, description="Secret with the certificate; unset: the controller's default one."
    )


class Ingress(ValuesModel):
    enabled: bool = False
    class_name: str = Field(default="", description="IngressClass; empty: the cluster's default class.")
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Controller settings, e.g. longer read timeouts for streams."
    )
    hosts: list[IngressHost] = Field(
        default_factory=list, description="Hosts and their paths; empty: any host, path /."
    )
    tls: list[IngressTLS] = Field(default_factory=list)


class ParentRef(Fragment):
    """gateway.networking.k8s.io/v1 ParentReference: the Gateway (listener) the route attaches to."""

    name: str = Field(min_length=1)
    namespace: str | None = None
    section_name: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    group: str | None = None
    kind: str | None = None


class RouteTimeouts(Fragment):
    request: str | None = Field(default=None, pattern=DURATION, description="Whole request; 0s: none.")
    backend_request: str | None = Field(
        default=None, pattern=DURATION, description="One try at the gateway; at most request."
    )


class HTTPRoute(ValuesModel):
    enabled: bool = False
    parent_refs: list[ParentRef] = Field(
        default_factory=list, description="Gateways to attach to (at least one when enabled)."
    )
    hostnames: list[str] = Field(default_factory=list, description="Empty: the listeners' hostnames.")
    annotations: dict[str, str] = Field(default_factory=dict)
    timeouts: RouteTimeouts = Field(
        default_factory=RouteTimeouts,
        description="Streamed completions last as long as generation: raise the implementation's "
        "default, e.g. {request: 3600s}, or 0s for none.",
    )
