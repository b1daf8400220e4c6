"""Tracing at the edge: install OpenTelemetry's SDK (OTLP over HTTP, batched) when
`--otlp-traces-endpoint` or the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variable asks for it.

The engine and the gateway use only the OpenTelemetry API, a no-op until this installs a provider.
The SDK and its exporter are the `tracing` extra.
"""

from __future__ import annotations

import logging
import urllib.parse

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
    service_name: str | None = Field(default=None, validation_alias="OTEL_SERVICE_NAME")


def traces_url(endpoint: str) -> str:
    """A base endpoint (http://host:4318) gets OTLP/HTTP's traces path; a full URL stays as it is."""
    parts = urllib.parse.urlsplit(endpoint)
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


def configure(default_service_name: str, endpoint_flag: str | None) -> str | None:
    """Install the tracer provider if tracing is asked for; the traces URL, or None when it is off."""
    settings = TracingSettings()
    if settings.is_sdk_disabled:
        return None
    if endpoint_flag:
        url = traces_url(endpoint_flag)
    elif settings.traces_endpoint:
        url = settings.traces_endpoint  # used as given, as the specification says
    elif settings.endpoint:
        url = traces_url(settings.endpoint)
    else:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ModuleNotFoundError as e:
        raise TracingUnavailable(
            f"tracing needs the Python package {e.name!r}, which is not installed: "
            "pip install 'corral[tracing]'"
        ) from e
    resource = Resource.create({SERVICE_NAME: settings.service_name or default_service_name})
    provider = TracerProvider(resource=resource)  # flushes its spans when the process exits
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    trace.set_tracer_provider(provider)
    log.info("tracing: spans of %s go to %s (OTLP/HTTP)", resource.attributes[SERVICE_NAME], url)
    return url
