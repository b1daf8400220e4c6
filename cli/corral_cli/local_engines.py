"""`corral engine` processes started on this machine by `corral up` and `corral run-batch`: each on
a free loopback port, logging to a file, ready once /health answers, stopped with SIGTERM (their
drain) and killed past a deadline."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from corral_cli import malloc
from corral_cli.listen import free_ports

logger = logging.getLogger(__name__)

ENGINE_READY_TIMEOUT_S = 300.0
DEFAULT_DRAIN_TIMEOUT_S = 5.0  # a local fleet: Ctrl-C should not wait the 30 s a pod's drain gets
ENGINE_STOP_MARGIN_S = 5.0


def _die_with_parent() -> None:
    """In the engine child: get SIGTERM if its parent (`corral up`, `corral run-batch`) dies, even
    by SIGKILL. Linux only."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class LogDir:
    """Where the engines log: --log-dir, kept; else a temporary directory, removed once the fleet
    stopped cleanly (an engine's log matters only when something failed)."""

    def __init__(self, requested: Path | None) -> None:
        self.requested = requested
        self.path: Path | None = None

    def create(self) -> Path:
        self.path = self.requested or Path(tempfile.mkdtemp(prefix="corral-up-"))
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def close(self, *, has_failed: bool) -> None:
        if self.path is None or self.requested is not None:
            return
        if has_failed:
            logger.warning("engine logs kept in %s", self.path)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


class LocalEngine:
    """One `corral engine` process: one replica, or `num_replicas` simulated ones."""

    def __init__(
        self,
        engine_flags: list[str],
        num_threads: int,
        log_dir: Path,
        log_flags: list[str],
        num_replicas: int = 1,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> None:
        ports = free_ports("127.0.0.1", num_replicas)  # a simulated fleet listens on several
        self.port = ports[0]
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.log_path = log_dir / f"engine-{self.port}.log"
        self.has_exited_early = False
        argv = [sys.executable, "-m", "corral_cli.main", *log_flags, "engine", *engine_flags]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--num-threads", str(num_threads)]
        # As long as the gateway's drain (the engine's own default is a pod's 20 s), so that
        # `_stop_engines` knows how long to wait; last on the line, it wins over an LLMDeployment's
        # args. Engines stop after the gateway has drained: what they still serve then is what
        # clients sent to them directly.
        argv += ["--drain-timeout", str(drain_timeout_s)]
        if num_replicas > 1:
            argv += ["--replicas", str(num_replicas)]
        with self.log_path.open("wb") as log:
            # Own session: Ctrl-C reaches only the parent, which stops the engines in order.
            self.proc = subprocess.Popen(
                argv,
                env=malloc.engine_env(os.environ),  # tcmalloc where installed (faster on CPU)
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def is_ready(self) -> bool:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"engine on port {self.port} exited with {self.proc.returncode}:\n{tail}")
        try:
            for url in self.urls:
                with urllib.request.urlopen(url + "/health", timeout=2.0) as response:
                    if response.status != 200:
                        return False
            return True
        except OSError:  # refused, reset, timed out, or an HTTP error status
            return False

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        else:
            self.has_exited_early = True  # before its parent stopped it: a crash, or a failed start

    def has_stopped_cleanly(self) -> bool:
        """Stopped by our SIGTERM: its drain ended (0), or the signal came before its handler."""
        return not self.has_exited_early and self.proc.returncode in (0, -signal.SIGTERM)

    def wait_or_kill(self, deadline_s: float) -> None:
        try:
            self.proc.wait(max(0.1, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_ready(engines: list[LocalEngine]) -> None:
    deadline_s = time.monotonic() + ENGINE_READY_TIMEOUT_S
    pending = list(engines)
    while pending:
        pending = [e for e in pending if not e.is_ready()]
        if time.monotonic() > deadline_s:
            raise RuntimeError(
                f"engines not healthy after {ENGINE_READY_TIMEOUT_S:.0f} s: see {pending[0].log_path}"
            )
        time.sleep(0.2)


def stop_engines(engines: list[LocalEngine], drain_timeout_s: float) -> None:
    for engine in engines:
        engine.terminate()
    deadline_s = time.monotonic() + drain_timeout_s + ENGINE_STOP_MARGIN_S
    for engine in engines:
        engine.wait_or_kill(deadline_s)
