"""The OpenTelemetry Collector for the tracing e2e: built by build.sh from the Go module proxy, run on
127.0.0.1 with an OTLP/HTTP receiver, exporting what it received as OTLP JSON to a sink in the test
process, where the test reads the spans."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.procs import HOST, ManagedProcess, free_port

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int  # OTLP's SpanKind: 2 server, 3 client
    attributes: dict[str, Any]


def _value(v: dict[str, Any]) -> Any:
    if "intValue" in v:
        return int(v["intValue"])  # a string in OTLP JSON
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return next(iter(v.values()), None)


def _attributes(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value") or {}) for a in items}


class SpanSink:
    """Receives the collector's OTLP/HTTP JSON exports."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                sink.add(body)
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def add(self, body: dict[str, Any]) -> None:
        with self._lock:
            for resource_spans in body.get("resourceSpans", []):
                resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
                for scope_spans in resource_spans.get("scopeSpans", []):
                    for s in scope_spans.get("spans", []):
                        self.spans.append(
                            Span(
                                str(resource.get("service.name")),
                                s["traceId"],
                                s["spanId"],
                                s.get("parentSpanId", ""),
                                s["name"],
                                int(s.get("kind", 0)),
                                _attributes(s.get("attributes", [])),
                            )
                        )

    def wait_for(self, names: set[str], timeout_s: float = 30.0, trace_id: str | None = None) -> list[Span]:
        """The spans received once every name is among them (among one trace's, given `trace_id`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if names <= {s.name for s in self.spans if trace_id in (None, s.trace_id)}:
                    return list(self.spans)
            time.sleep(0.1)
        with self._lock:
            raise AssertionError(
                f"spans {sorted(names)} not all received; got {[s.name for s in self.spans]}"
            )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def collector_binary() -> Path:
    """The built collector (building it when the cache is cold); skips without Go."""
    if shutil.which("go") is None:
        pytest.skip("Go is not installed: the tracing e2e builds the OpenTelemetry Collector with it")
    result = subprocess.run(
        ["bash", str(HERE / "build.sh")], capture_output=True, text=True, timeout=1800, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"building the OpenTelemetry Collector failed:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def _wait_listening(port: int, process: ManagedProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(f"the collector exited:\n{process.log_tail()}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        time.sleep(0.1)
    raise TimeoutError(f"the collector does not listen on {port}:\n{process.log_tail()}")


@contextlib.contextmanager
def running_collector(binary: Path, work_dir: Path) -> Iterator[tuple[str, SpanSink]]:
    """(the collector's OTLP/HTTP endpoint, the sink its exports arrive in)."""
    sink = SpanSink()
    port = free_port()
    config = {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"{HOST}:{port}"}}}},
        "exporters": {
            "otlphttp": {
                "endpoint": sink.url,
                "encoding": "json",
                "compression": "none",
                "retry_on_failure": {"enabled": False},
                "sending_queue": {"enabled": False},
            }
        },
        "service": {
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["otlphttp"]}},
        },
    }
    path = work_dir / "otelcol.yaml"
    path.write_text(yaml.safe_dump(config))
    process = ManagedProcess([str(binary), f"--config={path}"], port, name="otelcol", log_dir=work_dir)
    try:
        _wait_listening(port, process)
        yield f"http://{HOST}:{port}", sink
    finally:
        process.stop()
        sink.close()
