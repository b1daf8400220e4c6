"""A Kubernetes API stand-in on 127.0.0.1 for the gateway's watcher: namespaced lists and watches of
pods and LLMDeployments, answered from a dict; cluster-wide paths are 403, as for a gateway bound
only by Roles. Watches stay open and stream what `push` queues until `end` (that watch: the client
lists again) or `close` (all of them). Patches of one object (the gateway's wake-ups) are recorded."""

from __future__ import annotations

import json
import queue
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

NAMESPACED = re.compile(r"^/(?:api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)$")
OBJECT = re.compile(r"^/(?:api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)/([^/]+)$")
_CLOSE = object()
_END = object()


@dataclass
class FakeKubeApi:
    # (namespace, plural) -> items the list returns
    items: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    requests: list[tuple[str, bool]] = field(default_factory=list)  # (path, is_watch)
    patches: list[tuple[str, str, str, dict[str, Any]]] = field(
        default_factory=list
    )  # ns, plural, name, body
    _events: dict[tuple[str, str], queue.Queue[Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def events(self, namespace: str, plural: str) -> queue.Queue[Any]:
        with self._lock:
            return self._events.setdefault((namespace, plural), queue.Queue())

    def push(self, namespace: str, plural: str, event_type: str, obj: dict[str, Any]) -> None:
        self.events(namespace, plural).put({"type": event_type, "object": obj})

    def end(self, namespace: str, plural: str) -> None:
        self.events(namespace, plural).put(_END)

    def close(self) -> None:
        with self._lock:
            for events in self._events.values():
                events.put(_CLOSE)


def _handler(api: FakeKubeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet: the test reads api.requests
            return

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            is_watch = parse_qs(url.query).get("watch") == ["true"]
            api.requests.append((url.path, is_watch))
            match = NAMESPACED.match(url.path)
            if match is None:
                return self._send(403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
            key = (match.group(1), match.group(2))
            if is_watch:
                return self._stream(api.events(*key))
            listed = {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}}
            self._send(200, {**listed, "items": api.items.get(key, [])})

        def do_PATCH(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            match = OBJECT.match(urlsplit(self.path).path)
            if match is None:
                return self._send(403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
            namespace, plural, name = match.groups()
            api.patches.append((namespace, plural, name, body))
            self._send(200, {"metadata": {"namespace": namespace, "name": name}})

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, events: queue.Queue[Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while (event := events.get()) not in (_CLOSE, _END):
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            if event is _CLOSE:
                events.put(_CLOSE)  # for a watch opened after close
            self.wfile.write(b"0\r\n\r\n")
            self.close_connection = True

    return Handler


@contextmanager
def serve(api: FakeKubeApi, directory: Path, listen_after: threading.Event | None = None) -> Iterator[Path]:
    """Serves `api` on a free port of 127.0.0.1; yields a kubeconfig for it. With `listen_after`,
    the port is bound but refuses connections (an API server restarting) until the event is set."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api), bind_and_activate=False)
    server.daemon_threads = True
    server.server_bind()  # bound, not listening: connections are refused
    if listen_after is None:
        server.server_activate()

    def serve_forever() -> None:
        if listen_after is not None:
            listen_after.wait()
            server.server_activate()
        server.serve_forever()

    thread = threading.Thread(target=serve_forever, daemon=True)
    thread.start()
    kubeconfig = directory / "kubeconfig"
    cluster = {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
    context = {"name": "fake", "context": {"cluster": "fake", "user": "fake"}}
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "contexts": [context],
                "current-context": "fake",
                "users": [{"name": "fake", "user": {"token": "t"}}],
            }
        )
    )
    try:
        yield kubeconfig
    finally:
        api.close()
        if listen_after is not None:
            listen_after.set()  # shutdown() waits for serve_forever to have run
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
