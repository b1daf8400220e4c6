"""Why the engine exited, in its container's termination message, for `kubectl describe` and the
operator's status conditions: Kubernetes reads the file at terminationMessagePath
(/dev/termination-log by default, which the kubelet creates) when a container ends."""

from __future__ import annotations

import contextlib
import logging
import os

PATH_ENV = "CORRAL_TERMINATION_MESSAGE_PATH"  # another file, for tests and other supervisors
DEFAULT_PATH = "/dev/termination-log"
MAX_BYTES = 4096  # the kubelet keeps at most this much of it


class LastError(logging.Handler):
    """Remembers the last ERROR a logger said: the reason a start-up failure returns."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def write(message: str) -> None:
    """Leave `message` where the container's supervisor reads it; nothing where there is no such
    file (outside a container: it is never created here)."""
    path = os.environ.get(PATH_ENV, DEFAULT_PATH)
    if not path or not os.path.isfile(path):  # the kubelet mounts a plain file there
        return
    data = message.strip().encode()[-MAX_BYTES:]
    with contextlib.suppress(OSError), open(path, "wb") as f:
        f.write(data)
