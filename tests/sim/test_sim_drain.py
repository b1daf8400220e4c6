"""SIGTERM drains a simulated fleet (`corral engine --simulate ... --replicas N`) as it drains one
engine: every replica answers 503 to /health and to new requests, an open stream runs to its end
with `[DONE]`, then the process exits 0 and its ports close. A stream still open when the grace
period (--drain-timeout) ends gets an error event and `[DONE]`, not a cut connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from corral_cli.listen import free_ports

# Slow steps (0.1 s each), so the stream below is still open when the signal comes.
SLOW_PROFILE = {"kind": "fitted", "name": "slow", "num_kv_blocks": 256, "coefficients": [0.1, 0, 0, 0, 0]}
NUM_TOKENS = 40


def _start_fleet(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, ports: list[int], drain_timeout_s: float = 60
) -> subprocess.Popen[bytes]:
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps(SLOW_PROFILE))
    argv = [sys.executable, "-m", "corral_cli.main", "engine", "--simulate", str(profile)]
    argv += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(ports[0])]
    argv += ["--replicas", str(len(ports)), "--drain-timeout", str(drain_timeout_s)]
    log = (tmp_path / "engine.log").open("wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))


async def _wait_healthy(client: httpx.AsyncClient, urls: list[str], proc: subprocess.Popen[bytes]) -> None:
    for _ in range(1200):
        if proc.poll() is not None:
            raise AssertionError(f"the fleet exited with {proc.returncode} before serving")
        with contextlib.suppress(httpx.TransportError):
            statuses = [(await client.get(f"{url}/health")).status_code for url in urls]
            if statuses == [200] * len(urls):
                return
        await asyncio.sleep(0.1)
    raise AssertionError("the fleet did not become healthy")


async def _drain_while_streaming(
    proc: subprocess.Popen[bytes], urls: list[str], model: str, num_tokens: int = NUM_TOKENS
) -> list[str]:
    """Open a stream on the last replica, SIGTERM the process after its first token, check every
    replica refuses new work while the stream runs on; the stream's events."""
    body = {"model": model, "prompt": "one two three", "max_tokens": num_tokens, "stream": True}
    body["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=60) as client:
        await _wait_healthy(client, urls, proc)
        async with client.stream("POST", f"{urls[-1]}/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            events = [line async for line in _until_first_event(lines)]
            proc.send_signal(signal.SIGTERM)
            for url in urls:
                health = await _health_after_signal(client, url)
                assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
                r = await client.post(f"{url}/v1/completions", json={**body, "stream": False})
                assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            events += [line async for line in lines if line.startswith("data: ")]
    return events


async def _until_first_event(lines):  # type: ignore[no-untyped-def]
    async for line in lines:
        if line.startswith("data: "):
            yield line
            return


async def _health_after_signal(client: httpx.AsyncClient, url: str) -> httpx.Response:
    """/health once the signal has been handled (200 until then)."""
    for _ in range(600):
        r = await client.get(f"{url}/health")
        if r.status_code != 200:
            return r
        await asyncio.sleep(0.01)
    return r


def test_sigterm_drains_every_replica_and_lets_an_open_stream_finish(
    tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path
) -> None:
    ports = free_ports("127.0.0.1", 2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    proc = _start_fleet(tmp_path, tiny_model_dir, ports)
    try:
        events = asyncio.run(_drain_while_streaming(proc, urls, tiny_model_dir.name))
        assert proc.wait(timeout=60) == 0, (tmp_path / "engine.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert len(chunks) == NUM_TOKENS and chunks[-1]["choices"][0]["finish_reason"] == "length"
    for port in ports:  # drained, then closed
        with socket.socket() as s, contextlib.suppress(OSError):
            assert s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_a_stream_open_when_the_grace_period_ends_gets_an_error_and_done(
    tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path, num_replicas: int
) -> None:
    """One replica is the engine server's own drain (`lifecycle.DrainingServer`), two the fleet's."""
    ports = free_ports("127.0.0.1", num_replicas)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    proc = _start_fleet(tmp_path, tiny_model_dir, ports, drain_timeout_s=0.5)
    try:  # 200 steps of 0.1 s: far longer than the grace period
        events = asyncio.run(_drain_while_streaming(proc, urls, tiny_model_dir.name, num_tokens=200))
        assert proc.wait(timeout=60) == 0, (tmp_path / "engine.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "draining"
    assert len(events) < 200
