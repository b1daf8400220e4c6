"""Runs one system at a time as subprocesses with timeouts: its offline worker, then its HTTP server
driven by `corral bench`. A failure is recorded in the result and the comparison goes on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine_metrics
import proc_cpu
from systems import Settings, System

log = logging.getLogger("compare")
SERVER_START_TIMEOUT_S = 900.0  # vLLM compiles its model on first start
_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class ServedRun:
    """One `corral bench` run against a server: a workload file replayed at a request rate."""

    key: str  # e.g. "W2@inf"
    dataset: Path
    num_prompts: int
    rate: str


def _follow(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float, tag: str) -> int | None:
    """Wait for `proc`, echoing the worker's own progress lines; None on timeout (process killed)."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        rc = proc.poll()
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        lines = text.splitlines()
        for line in lines[seen:]:
            if " worker " in line:
                log.info("  [%s] %s", tag, line.split(" worker ", 1)[1])
        seen = len(lines)
        if rc is not None:
            return rc
        if time.monotonic() > deadline:
            _stop(proc)
            return None
        time.sleep(_POLL_S)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process group we started (servers spawn engine-core children), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


def run_offline(
    system: System,
    model: Path,
    workloads: dict[str, Path],
    out_dir: Path,
    settings: Settings,
    timeout_s: float,
) -> dict[str, Any]:
    out = out_dir / f"offline-{system.name}.json"
    log_path = out_dir / f"offline-{system.name}.log"
    out.unlink(missing_ok=True)
    cmd = system.offline_cmd(model, workloads, out, settings)
    log.info("[%s] offline: %s", system.name, " ".join(Path(c).name if "/" in c else c for c in cmd[:2]))
    t0 = time.monotonic()
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env=system.full_env(), start_new_session=True
        )
        try:
            rc = _follow(proc, log_path, timeout_s, system.name)
        finally:
            _stop(proc)  # also on Ctrl-C: the worker runs in its own session
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"workloads": {}}
    result["wall_s"] = time.monotonic() - t0
    if rc != 0:
        result["error"] = f"timed out after {timeout_s:.0f} s" if rc is None else f"exit code {rc}"
        result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-12:]
        log.warning("[%s] offline failed: %s (log: %s)", system.name, result["error"], log_path)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """None when /v1/models answers; otherwise why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited with code {proc.returncode} before it was ready"
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2.0)
    return f"server not ready after {timeout_s:.0f} s"


def run_served(
    system: System, model: Path, runs: list[ServedRun], out_dir: Path, settings: Settings, timeout_s: float
) -> dict[str, Any]:
    """Start the server, replay each run with `corral bench` (streaming completions), stop the server."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = out_dir / f"server-{system.name}.log"
    result: dict[str, Any] = {"system": system.name, "runs": {}}
    log.info("[%s] starting server on port %d", system.name, port)
    t0 = time.monotonic()
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(
            system.server_cmd(model, port, settings),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=system.full_env(),
            start_new_session=True,
        )
        try:
            problem = wait_ready(base_url, proc, SERVER_START_TIMEOUT_S)
            result["startup_s"] = time.monotonic() - t0
            if problem is not None:
                result["error"] = problem
                result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-12:]
                log.warning("[%s] %s (log: %s)", system.name, problem, log_path)
                return result
            log.info("[%s] server ready after %.0f s", system.name, result["startup_s"])
            _bench(
                base_url, model, runs, out_dir, system.name, result, timeout_s, settings.temperature, proc.pid
            )
        finally:
            _stop(proc)
    return result


def _bench(
    base_url: str,
    model: Path,
    runs: list[ServedRun],
    out_dir: Path,
    name: str,
    result: dict[str, Any],
    timeout_s: float,
    temperature: float = 0.0,
    server_pid: int | None = None,
) -> None:
    # A tiny warm-up request so first-request costs do not land in the first measured run.
    warm = out_dir / "warmup.jsonl"
    warm.write_text(json.dumps({"prompt": list(range(100, 132)), "output_len": 4}) + "\n")
    for run in [ServedRun("warmup", warm, 1, "inf"), *runs]:
        out = out_dir / f"served-{name}-{run.key.replace('@', '-at-')}.json"
        out.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "corral_cli.main", "bench", "--base-url", base_url,
            "--dataset", str(run.dataset), "--num-prompts", str(run.num_prompts),
            "--tokenizer", str(model), "--ignore-eos", "--request-rate", run.rate,
            "--seed", "0", "--no-progress", "--result-file", str(out), "--temperature", str(temperature),
        ]  # fmt: skip
        if run.key != "warmup":
            log.info("[%s] served %s: %d requests at rate %s", name, run.key, run.num_prompts, run.rate)
        before = engine_metrics.scrape(base_url)
        threads_before = proc_cpu.snapshot(server_pid) if server_pid else {}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            result["runs"][run.key] = {"error": f"corral bench timed out after {timeout_s:.0f} s"}
            log.warning("[%s] %s timed out", name, run.key)
            continue
        threads_after = proc_cpu.snapshot(server_pid) if server_pid else {}
        if run.key == "warmup":
            continue
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
            result["runs"][run.key] = {"error": f"corral bench exit {proc.returncode}", "log_tail": tail}
            log.warning("[%s] %s failed: %s", name, run.key, tail[-1:] if tail else "")
            continue
        summary = json.loads(out.read_text())["runs"][0]
        summary["engine"] = engine_metrics.delta(before, engine_metrics.scrape(base_url))
        summary["cpu"] = proc_cpu.delta(threads_before, threads_after, server_pid) if server_pid else None
        result["runs"][run.key] = summary
        log.info(
            "[%s] %s: %.1f output tok/s, TTFT p99 %.0f ms, TPOT median %.1f ms, %d failed",
            name,
            run.key,
            summary["output_throughput"],
            summary["p99_ttft_ms"],
            summary["median_tpot_ms"] or float("nan"),
            summary["failed"],
        )
        if summary["engine"]:
            log.info("[%s] %s engine side: %s", name, run.key, engine_metrics.describe(summary["engine"]))
        if summary["cpu"]:
            cpu_text = proc_cpu.describe(
                summary["cpu"], summary["total_output_tokens"], summary.get("client_cpu_s")
            )
            log.info("[%s] %s CPU: %s", name, run.key, cpu_text)
