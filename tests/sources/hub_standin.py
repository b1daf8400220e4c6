"""A stand-in for the Hugging Face Hub (no public Hub is reachable offline): a loopback HTTP server
that serves checkpoint directories as model repositories through the endpoints huggingface_hub
calls (`/api/models/{repo}/revision/{rev}`, `/api/models/{repo}/tree/{rev}`, and
`/{repo}/resolve/{rev}/{file}` with HEAD and ranged GET), with the Hub's error headers, optional
bearer tokens, and a count of every request so tests can see how often files were downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".bin")


@dataclass
class Repo:
    directory: Path
    # token -> HTTP status for it (200 full access, 403 no access to this repo); None: public.
    tokens: dict[str, int] | None = None


@dataclass
class HubStandIn:
    """`with HubStandIn({"org/name": Repo(dir)}) as hub:` then HF_ENDPOINT=hub.url."""

    repos: dict[str, Repo]
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    # Per-chunk delay of file bodies, to hold a download open while a test races another against it.
    chunk_delay_s: float = 0.0
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def file_gets(self, name: str) -> int:
        """How many GETs of `name` (any repo, any revision) the server answered."""
        return sum(
            n for (method, path), n in self.requests.items() if method == "GET" and path.endswith("/" + name)
        )

    def __enter__(self) -> HubStandIn:
        hub = self

        class Handler(_Handler):
            standin = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True).start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    standin: HubStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        return

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, *, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.standin.requests[(self.command, path)] += 1
        self.standin.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/") :]
            for kind in ("revision", "tree"):
                repo, sep, tail = rest.partition(f"/{kind}/")
                if sep:
                    return self._api(kind, repo, tail.split("/", 1)[0])
        elif "/resolve/" in path:
            repo, _, tail = path.lstrip("/").partition("/resolve/")
            revision, _, name = tail.partition("/")
            return self._file(repo, revision, name, head=head)
        self._error(404, "RepoNotFound")

    def _repo(self, name: str, revision: str) -> Repo | None:
        repo = self.standin.repos.get(name)
        if repo is None:
            self._error(404, "RepoNotFound")
            return None
        if repo.tokens is not None:
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
            if token is None:
                self._error(401, "RepoNotFound")
                return None
            status = repo.tokens.get(token)
            if status is None:
                self._error(401, None, "Invalid credentials in Authorization header")
                return None
            if status != 200:
                self._error(status, None, "Forbidden")
                return None
        if revision not in ("main", COMMIT):
            self._error(404, "RevisionNotFound")
            return None
        return repo

    def _api(self, kind: str, name: str, revision: str) -> None:
        repo = self._repo(name, revision)
        if repo is None:
            return
        files = sorted(p for p in repo.directory.iterdir() if p.is_file())
        if kind == "revision":
            body = {"id": name, "modelId": name, "sha": COMMIT, "private": repo.tokens is not None,
                    "siblings": [{"rfilename": p.name} for p in files]}  # fmt: skip
            return self._json(body)
        tree = []
        for p in files:
            data = p.read_bytes()
            entry: dict[str, object] = {
                "type": "file",
                "oid": _git_blob_oid(data),
                "size": len(data),
                "path": p.name,
            }
            if p.suffix in LFS_SUFFIXES:
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            tree.append(entry)
        self._json(tree)

    def _file(self, name: str, revision: str, filename: str, *, head: bool) -> None:
        repo = self._repo(name, revision)
        if repo is None:
            return
        path = repo.directory / filename
        if not path.is_file() or ".." in filename:
            return self._error(404, "EntryNotFound")
        data = path.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if path.suffix in LFS_SUFFIXES else _git_blob_oid(data)
        start = 0
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes=") and ranged[6:].endswith("-"):
            start = min(int(ranged[6:-1]), len(data))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if head:
            return
        body = memoryview(data)[start:]
        step = 64 << 10
        for offset in range(0, len(body), step):
            self.wfile.write(body[offset : offset + step])
            if self.standin.chunk_delay_s:
                threading.Event().wait(self.standin.chunk_delay_s)

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str | None = None) -> None:
        data = json.dumps({"error": message or code or "error"}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
