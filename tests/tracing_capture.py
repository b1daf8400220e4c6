"""Capture the spans a package's `tracing` module makes, on a private SDK provider (the
process-wide provider stays the no-op); shared by the gateway's and the engine's tracing tests."""

from __future__ import annotations

from types import ModuleType

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def capture_spans(monkeypatch: pytest.MonkeyPatch, tracing: ModuleType) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "is_enabled", lambda: True)
    return exporter
