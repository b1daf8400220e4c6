"""Download progress: a bar on a terminal, JSON lines otherwise, measured from the bytes on disk."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from corral_engine.sources.progress import PROGRESS_EVENT, Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _grow(directory: Path, num_bytes: int) -> None:
    with (directory / "model.safetensors.incomplete").open("ab") as fh:
        fh.write(b"\0" * num_bytes)


def test_json_lines_follow_the_bytes_on_disk(tmp_path: Path) -> None:
    stream = io.StringIO()
    with Progress(tmp_path, 3000, "hf://o/n", stream=stream, interval_s=0.05):
        _grow(tmp_path, 1000)
        time.sleep(0.2)
        _grow(tmp_path, 2000)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert all(line["event"] == PROGRESS_EVENT and line["model"] == "hf://o/n" for line in lines)
    assert any(line["downloaded_bytes"] == 1000 and not line["done"] for line in lines)
    assert (lines[-1]["downloaded_bytes"], lines[-1]["total_bytes"], lines[-1]["done"]) == (3000, 3000, True)


def test_a_terminal_gets_a_bar(tmp_path: Path) -> None:
    stream = _Terminal()
    with Progress(tmp_path, 2048, "s3://b/p", stream=stream, interval_s=0.05):
        _grow(tmp_path, 2048)
        time.sleep(0.15)
    text = stream.getvalue()
    assert "s3://b/p: 100%" in text and "2.05k/2.05k" in text and PROGRESS_EVENT not in text


def test_disabled_reports_nothing(tmp_path: Path) -> None:
    stream = io.StringIO()
    with Progress(tmp_path, 10, "x", stream=stream, enabled=False):
        _grow(tmp_path, 10)
    assert stream.getvalue() == ""
