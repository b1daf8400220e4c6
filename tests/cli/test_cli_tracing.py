"""Tracing at the edge: off unless --otlp-traces-endpoint or OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT asks,
the traces URL derived as the OpenTelemetry specification says, and a missing SDK named by its extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from corral_cli import tracing
from corral_cli.main import build_parser

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_traces_url() -> None:
    assert tracing.traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert tracing.traces_url("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/custom/traces") == "http://c:4318/custom/traces"


def test_off_unless_asked() -> None:
    assert tracing.configure("corral-test", None) is None


def test_sdk_disabled_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.configure("corral-test", "http://127.0.0.1:4318") is None


def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(tracing.TracingUnavailable, match=r"pip install 'corral\[tracing\]'"):
        tracing.configure("corral-test", "http://127.0.0.1:4318")


@pytest.mark.parametrize(
    ("env", "flag", "url"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, None, "http://127.0.0.1:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/t"}, None, "http://127.0.0.1:9/t"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
            "http://127.0.0.1:2",
            "http://127.0.0.1:2/v1/traces",
        ),
    ],
)
def test_on_from_the_environment_or_the_flag(env: dict[str, str], flag: str | None, url: str) -> None:
    # In a child process: installing the provider is process-wide and cannot be undone.
    code = (
        "from corral_cli import tracing; from opentelemetry import trace; "
        f"print(tracing.configure('corral-test', {flag!r})); "
        "print(type(trace.get_tracer_provider()).__module__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**_base_env(), **env}, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [url, "opentelemetry.sdk.trace"]


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in OTEL_VARS}


@pytest.mark.parametrize("command", ["engine", "gateway"])
def test_engine_and_gateway_take_the_flag(command: str) -> None:
    argv = [command, "--otlp-traces-endpoint", "http://127.0.0.1:4318"]
    argv += ["--model", "m"] if command == "engine" else ["--backend", "m=http://127.0.0.1:1"]
    assert build_parser(only=command).parse_args(argv).otlp_traces_endpoint == "http://127.0.0.1:4318"


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the Python package"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc needs"),
        (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "http/json",
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported",
        ),
    ],
)
def test_a_protocol_that_cannot_be_served_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    """It was ignored: spans went over OTLP/HTTP to what was likely a gRPC port (4317), and only
    the SDK's export errors followed. The gRPC exporter is not installed here."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc", None)
    monkeypatch.setenv(variable, value)
    with pytest.raises(tracing.TracingUnavailable, match=re.escape(says)):
        tracing.configure("corral-test", "http://127.0.0.1:4317")


def test_grpc_is_used_where_its_exporter_is_installed() -> None:
    # In a child process (the provider is process-wide), with a stand-in for the gRPC exporter.
    code = """
import sys, types
from corral_cli import tracing
class Exporter:
    def __init__(self, endpoint): print("grpc", endpoint)
    def shutdown(self): pass
package = types.ModuleType("opentelemetry.exporter.otlp.proto.grpc")
module = types.ModuleType("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
module.OTLPSpanExporter = Exporter
sys.modules[package.__name__], sys.modules[module.__name__] = package, module
print(tracing.configure("corral-test", None))
"""
    env = {**_base_env(), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "grpc"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["grpc", "http://127.0.0.1:4317", "http://127.0.0.1:4317"]
