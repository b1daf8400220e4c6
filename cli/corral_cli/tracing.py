"""Tracing at the edge: install OpenTelemetry's SDK (OTLP over HTTP, batched) when
`--otlp-traces-endpoint` or the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variable asks for it;
OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL=grpc where the gRPC exporter is installed, else refused.

The engine and the gateway use only the OpenTelemetry API, a no-op until this installs a provider.
The SDK and its exporter are the `tracing` extra.
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)
TRACES_PATH = "/v1/traces"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for, but the SDK is not installed."""


class TracingSettings(BaseSettings):
    """The standard OpenTelemetry variables Corral reads itself (the SDK reads the rest, such as
    OTEL_EXPORTER_OTLP_HEADERS, OTEL_RESOURCE_ATTRIBUTES and OTEL_BSP_*)."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    traces_endpoint: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    endpoint: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT")
    is_sdk_disabled: bool = Field(default=False, validation_alias="OTEL_SDK_DISABLED")
    traces_protocol: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    protocol: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_PROTOCOL")
    service_name: str | None = Field(default=None, validation_alias="OTEL_SERVICE_NAME")


def traces_url(endpoint: str) -> str:
    """A base endpoint (http://host:4318) gets OTLP/HTTP's traces path; a full URL stays as it is."""
    parts = urllib.parse.urlsplit(endpoint)
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


def _protocol(settings: TracingSettings) -> tuple[str, str]:
    """The OTLP transport asked for, and the variable that asked ("" for the default, HTTP)."""
    for name, value in (
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", settings.traces_protocol),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", settings.protocol),
    ):
        if value:
            return value.strip().lower(), name
    return "http/protobuf", ""


def _exporter(protocol: str, variable: str, url: str, endpoint: str) -> Any:
    """The span exporter for `protocol`: OTLP/HTTP (the extra's), or gRPC where its exporter is
    installed; anything else is refused, naming the variable, rather than sent over HTTP to what
    may be a gRPC port (the SDK's export errors would not say why)."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=url)
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ModuleNotFoundError:
            raise TracingUnavailable(
                f"{variable}=grpc needs the Python package 'opentelemetry-exporter-otlp-proto-grpc', "
                "which is not installed: install it, or unset the variable (or set it to "
                "http/protobuf) and send to the collector's OTLP/HTTP port (4318)"
            ) from None
        return Grpc(endpoint=endpoint)  # gRPC has no path: the endpoint as given
    raise TracingUnavailable(
        f"{variable}={protocol!r} is not supported: Corral exports traces over OTLP "
        "'http/protobuf', or 'grpc' with opentelemetry-exporter-otlp-proto-grpc installed"
    )


def configure(default_service_name: str, endpoint_flag: str | None) -> str | None:
    """Install the tracer provider if tracing is asked for; the traces URL, or None when it is off."""
    settings = TracingSettings()
    if settings.is_sdk_disabled:
        return None
    if endpoint_flag:
        endpoint = endpoint_flag
        url = traces_url(endpoint_flag)
    elif settings.traces_endpoint:
        endpoint = url = settings.traces_endpoint  # used as given, as the specification says
    elif settings.endpoint:
        endpoint = settings.endpoint
        url = traces_url(settings.endpoint)
    else:
        return None
    protocol, variable = _protocol(settings)
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = _exporter(protocol, variable, url, endpoint)
    except ModuleNotFoundError as e:
        raise TracingUnavailable(
            f"tracing needs the Python package {e.name!r}, which is not installed: "
            "pip install 'corral[tracing]'"
        ) from e
    if protocol == "grpc":
        url = endpoint
    resource = Resource.create({SERVICE_NAME: settings.service_name or default_service_name})
    provider = TracerProvider(resource=resource)  # flushes its spans when the process exits
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    transport = "OTLP/gRPC" if protocol == "grpc" else "OTLP/HTTP"
    log.info("tracing: spans of %s go to %s (%s)", resource.attributes[SERVICE_NAME], url, transport)
    return url
