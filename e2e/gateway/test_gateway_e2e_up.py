"""`corral up`: engines and a gateway on this machine, usable with the openai client, stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from e2e.gateway.conftest import wait_for
from e2e.procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_corral_up_serves_and_stops_cleanly(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "up.log"
    argv = [sys.executable, "-m", "corral_cli.main", "up", "--model", str(tiny_model_dir), "--replicas", "2"]
    argv += ["--port", str(port), "--served-model-name", "tiny", "--log-dir", str(tmp_path)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("the banner", lambda: "Corral is up" in log_path.read_text(errors="replace"), timeout_s=180)
        banner = log_path.read_text()
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        replicas = httpx.get(f"http://127.0.0.1:{port}/corral/replicas").json()["models"]["tiny"]
        engine_urls = [r["url"] for r in replicas]
        assert len(engine_urls) == 2 and all(r["healthy"] for r in replicas)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        for url in [f"http://127.0.0.1:{port}", *engine_urls]:
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:  # a failed assertion: still stop the fleet the clean way
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_corral_up_stops_quietly_on_a_double_ctrl_c(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C twice in quick succession (the terminal signals the whole process group): the same
    graceful stop, exit 0, no traceback. uvicorn's own handler forced an exit on the second one,
    which cancelled the gateway's shutdown halfway and printed a traceback."""
    port = free_port()
    log_path = tmp_path / "up.log"
    argv = [sys.executable, "-m", "corral_cli.main", "up", "--model", str(tiny_model_dir), "--replicas", "1"]
    argv += ["--port", str(port), "--log-dir", str(tmp_path)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the banner", lambda: "Corral is up" in log_path.read_text(errors="replace"), timeout_s=180)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
        output = log_path.read_text(errors="replace")
        assert "stopping 1 engine process" in output
        assert "Traceback" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
