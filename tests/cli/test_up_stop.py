"""`corral up` stops as a gateway pod does: Ctrl-C drains for --drain-timeout, then the streams
still open end with a `draining` error event and `[DONE]`, not a cut connection; its engines
drain for the same time."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
from corral_cli.listen import free_ports

from tests.cli.up_process import wait_for_banner


def test_ctrl_c_ends_an_open_stream_with_the_draining_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_ports("127.0.0.1", 1)[0]
    argv = [sys.executable, "-m", "corral_cli.main", "up", "--simulate", "h100-llama3-8b"]
    argv += ["--model", str(tiny_model_dir), "--replicas", "1", "--port", str(port)]
    argv += ["--drain-timeout", "2", "--log-dir", str(tmp_path)]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_banner(up)
        body = {"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 8000, "ignore_eos": True}
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            events = r.iter_lines()
            assert next(events).startswith("data: {")  # generating
            up.send_signal(signal.SIGINT)
            last = [line for line in events if line][-2:]
        _, stderr = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert '"code": "draining"' in last[0] and last[1] == "data: [DONE]"
    assert up.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    (engine_log,) = tmp_path.glob("engine-*.log")
    assert "draining (0 open requests, grace 2s)" in engine_log.read_text()
