"""`corral up` without --log-dir logs its engines into a temporary directory: removed when the fleet
stops cleanly, kept (and its path logged) when an engine failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from corral_cli.listen import free_ports

from tests.cli.up_process import wait_for_banner


def _up(tmp_path: Path, profile: str, model_dir: Path) -> subprocess.Popen[str]:
    """`corral up --simulate PROFILE` (one process of simulated replicas, no torch), TMPDIR in tmp_path."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "corral_cli.main", "up", "--simulate", profile, "--model", str(model_dir)]
    argv += ["--replicas", "2", "--port", str(free_ports("127.0.0.1", 1)[0])]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_clean_stop_removes_the_temporary_logs(tmp_path: Path, tiny_model_dir: Path) -> None:
    up = _up(tmp_path, "h100-llama3-8b", tiny_model_dir)
    try:
        wait_for_banner(up)
        assert [p.name.startswith("corral-up-") for p in (tmp_path / "tmp").iterdir()] == [True]
        up.send_signal(signal.SIGTERM)
        _, stderr = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, stderr
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_failed_engine_keeps_its_logs_and_says_where(tmp_path: Path) -> None:
    # `corral up` checks the profile and that tokenizer.json is there; only the engine reads it.
    model_dir = tmp_path / "broken-tokenizer"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("not a tokenizer")
    up = _up(tmp_path, "h100-llama3-8b", model_dir)
    try:
        _, stderr = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 1, stderr
    (log_dir,) = (tmp_path / "tmp").iterdir()
    assert f"engine logs kept in {log_dir}" in stderr
    (log,) = log_dir.iterdir()
    assert "tokenizer.json" in log.read_text()
