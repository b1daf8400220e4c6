"""Child processes of the test control plane: each in its own process group with its own log file.

Every child also gets PR_SET_PDEATHSIG, so a pytest killed without running its finalizers still takes
the control plane down with it instead of leaving it on the shared machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STOP_TIMEOUT_S = 10.0


def _die_with_parent() -> None:
    # Runs in the child between fork and exec.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ManagedProcess:
    """One long-running component (etcd, kube-apiserver, ...) started in a new process group."""

    def __init__(self, name: str, argv: Sequence[str | Path], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self._popen = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        logger.info("started %s (pid %d), log %s", name, self._popen.pid, self.log_path)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def is_running(self) -> bool:
        return self._popen.poll() is None

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])

    def describe_exit(self) -> str:
        """A message for a component that stopped on its own, with the end of its log."""
        return f"{self.name} exited with code {self._popen.returncode}; last log lines:\n{self.log_tail()}"

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after a grace period; safe to call twice."""
        if self._popen.poll() is not None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self._popen.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop after SIGTERM; killing it", self.name)
            self._signal_group(signal.SIGKILL)
            self._popen.wait(timeout=_STOP_TIMEOUT_S)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, sig)
