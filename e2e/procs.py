"""Real processes for end-to-end tests: start on a free 127.0.0.1 port, wait for health, stop cleanly.

    with start_engine(model_dir, max_waiting=4) as engine:
        httpx.get(engine.url + "/v1/models")
        engine.metric("vllm:num_requests_running")

Logs go to a file (`.log_path`, its tail is in every startup error): in the test's `log_dir`, else
under one directory of the test run's, removed when it ends. Leaving the `with` block sends
SIGTERM, waits, then SIGKILLs, so no test leaves a process behind.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from corral_cli.listen import free_ports
from corral_engine.sources.uri import parse_model_uri
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
# A guard against a hang, not a measurement: a tiny-model engine starts in ~25 s on a busy 2-core
# machine, and took over 120 s twice at load average 7-11 (weight prepacking alone 51 s).
READY_TIMEOUT_S = 300.0


@functools.cache
def _run_log_root() -> Path:
    """Where the logs of processes started without a `log_dir` go: one directory for the test run
    (each process's in its own below it), removed when the run ends, so no run leaves them behind."""
    root = Path(tempfile.mkdtemp(prefix="corral-e2e-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def free_port() -> int:
    """A port nothing is bound to, below the kernel's ephemeral range (corral_cli.listen.free_ports
    says why: a server binds its port some time after the pick)."""
    return free_ports(HOST, 1)[0]


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """{"max_waiting": 4, "no_prefix_caching": True, "seed": None} -> --max-waiting 4 --no-prefix-caching."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


class ManagedProcess:
    """A server process on 127.0.0.1:`port`, ready once GET `health_path` answers 200."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        *,
        name: str = "proc",
        health_path: str = "/health",
        log_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = argv
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.health_path = health_path
        log_root = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(dir=_run_log_root()))
        log_root.mkdir(parents=True, exist_ok=True)
        self.log_path = log_root / f"{name}-{port}.log"
        self._log = self.log_path.open("wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    raise RuntimeError(f"{self.argv[:4]} exited with {code}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + self.health_path).status_code == 200:
                        return
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"not healthy after {timeout_s}s:\n{self.log_tail()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def metrics_text(self) -> str:
        r = httpx.get(self.url + "/metrics", timeout=10.0)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """sample name -> [(labels, value)], from one scrape parsed by prometheus-client."""
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels` (0 if none)."""
        return sum(
            value
            for sample_labels, value in self.metrics().get(name, [])
            if all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class EngineProcess(ManagedProcess):
    def __init__(self, model_dir: str | Path, port: int, flags: dict[str, Any], **kwargs: Any) -> None:
        argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", str(model_dir)]
        argv += ["--host", HOST, "--port", str(port), *flags_to_argv(flags)]
        super().__init__(argv, port, name="engine", **kwargs)
        default_name = parse_model_uri(str(model_dir)).default_served_name  # as `corral engine` names it
        self.served_model_name = str(flags.get("served_model_name") or default_name)

    def __enter__(self) -> EngineProcess:
        return self


def start_engine(
    model_dir: str | Path,
    *,
    log_dir: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    **flags: Any,
) -> EngineProcess:
    """Start `corral engine --model DIR` with `flags` (python names: max_waiting=4) and wait for /health."""
    engine = EngineProcess(model_dir, free_port(), flags, log_dir=log_dir, env=env)
    engine.wait_ready(timeout_s)
    return engine
