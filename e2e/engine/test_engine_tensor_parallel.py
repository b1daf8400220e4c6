"""`corral engine --tensor-parallel-size 2` as real processes: it serves the same greedy text as one
rank; a rank killed mid-step ends the engine within seconds with an error naming it, and SIGTERM
stops every rank; no process outlives the engine."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import threading
import time

import httpx
import pytest

from e2e.procs import start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FLAGS = {"dtype": "float32", "num_kv_blocks": 256, "tensor_parallel_size": 2}


def _children(pid: int) -> list[int]:
    """Every process under `pid` (worker ranks, multiprocessing's helpers)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            for child in map(int, text):
                out += [child, *_children(child)]
    return out


def _is_alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_is_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _is_alive(p)]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return pathlib.Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    return ""


def _is_spawned(pid: int) -> bool:
    return "spawn_main" in _cmdline(pid) and "resource_tracker" not in _cmdline(pid)


def _is_rank(pid: int) -> bool:
    """A worker rank: spawned and spawning nothing (an engine core in its own process spawns the ranks)."""
    return _is_spawned(pid) and not any(_is_spawned(c) for c in _children(pid))


# CORRAL_ENGINE_PROCESS: rank 0 in the server's process, or in an engine core process of its own.
LAYOUTS = pytest.mark.parametrize("layout", ["0", "1"], ids=["one-process", "engine-core-process"])


def test_two_ranks_serve_the_one_rank_text_and_stop_on_sigterm(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    body = {"prompt": "the tensor parallel check", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    texts = []
    for flags in ({**FLAGS, "tensor_parallel_size": None}, FLAGS):
        engine = start_engine(tiny_model_dir, log_dir=tmp_path, **flags)
        r = httpx.post(engine.url + "/v1/completions", json={**body, "model": engine.served_model_name})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
        descendants = _children(engine.proc.pid)
        assert engine.stop() == 0, engine.log_tail()
        assert _wait_gone(descendants, 10.0) == [], engine.log_tail()
    assert texts[0] == texts[1]


@LAYOUTS
def test_a_rank_killed_mid_step_ends_the_engine_with_an_error(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, layout: str
) -> None:
    engine = start_engine(tiny_model_dir, log_dir=tmp_path, env={"CORRAL_ENGINE_PROCESS": layout}, **FLAGS)
    descendants = _children(engine.proc.pid)
    (rank1,) = [p for p in descendants if _is_rank(p)]
    body = {"model": engine.served_model_name, "prompt": "long", "max_tokens": 400, "ignore_eos": True}
    streamed = threading.Event()

    def stream() -> None:
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream(
                "POST", engine.url + "/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r,
        ):
            for _ in r.iter_lines():
                streamed.set()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert streamed.wait(60), engine.log_tail()
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    try:
        code = engine.proc.wait(10)
    except subprocess.TimeoutExpired:
        engine.stop()
        pytest.fail(f"the engine outlived its dead rank by 10 s:\n{engine.log_tail()}")
    assert time.monotonic() - killed_at < 10
    assert code == 1
    assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in engine.log_tail()
    assert _wait_gone(descendants, 10.0) == []
    engine.stop()


@LAYOUTS
def test_workers_leave_when_the_server_is_killed(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, layout: str
) -> None:
    engine = start_engine(tiny_model_dir, log_dir=tmp_path, env={"CORRAL_ENGINE_PROCESS": layout}, **FLAGS)
    descendants = _children(engine.proc.pid)
    assert any(_is_rank(p) for p in descendants)
    engine.signal(signal.SIGKILL)  # no drain, no atexit: only the closed pipe tells the workers
    engine.proc.wait(10)
    assert _wait_gone(descendants, 10.0) == []
    engine.stop()
