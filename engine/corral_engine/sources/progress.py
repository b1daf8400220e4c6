"""Download progress, the same for every source: a thread measures the bytes under the entry's
directory (finished files and the clients' partial ones) against the total the source listed, and
shows a bar on a terminal or writes a JSON line to stderr every few seconds otherwise (init
containers' logs; the operator's half reads the last one)."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

PROGRESS_EVENT = "corral.fetch.progress"


def bytes_under(directory: Path) -> int:
    total = 0
    for path in directory.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue  # renamed or removed while we looked
    return total


def _terminal_size() -> dict[str, int]:
    """tqdm's ncols and nrows. A terminal that reports 0x0 (a bare pty) gets 80x24: tqdm hides bars
    beyond the last row, so 0 rows would show nothing."""
    columns, lines = shutil.get_terminal_size((80, 24))
    return {"ncols": columns or 80, "nrows": lines or 24}


class Progress:
    """`with Progress(dir, total, name):` reports until the block ends; `interval_s` between reports."""

    def __init__(
        self,
        directory: Path,
        total_bytes: int,
        name: str,
        *,
        stream: TextIO | None = None,
        interval_s: float | None = None,
        enabled: bool = True,
    ) -> None:
        self.directory, self.total_bytes, self.name = directory, total_bytes, name
        self.stream = stream or sys.stderr
        self.is_tty = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.is_tty else 5.0)
        self.enabled = enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: object | None = None
        self._start_bytes = 0

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        self._start_bytes = bytes_under(self.directory) if self.directory.exists() else 0
        if self.is_tty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_bytes, initial=self._start_bytes, unit="B", unit_scale=True,
                desc=self.name, file=self.stream, **_terminal_size(),
            )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._report(done=exc is None)
        if self._bar is not None:
            self._bar.close()  # type: ignore[attr-defined]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._report(done=False)

    def _report(self, *, done: bool) -> None:
        done_bytes = min(bytes_under(self.directory), self.total_bytes) if self.directory.exists() else 0
        if self._bar is not None:
            self._bar.update(done_bytes - self._bar.n)  # type: ignore[attr-defined]
            return
        line = {
            "event": PROGRESS_EVENT,
            "model": self.name,
            "downloaded_bytes": done_bytes,
            "total_bytes": self.total_bytes,
            "done": done,
            "time": round(time.time(), 3),
        }
        self.stream.write(json.dumps(line) + "\n")
        self.stream.flush()
