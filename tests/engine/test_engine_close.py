"""Closing an engine from Python: `LLMEngine.close()` and `with`, `async with` for the asyncio
fronts, a collected engine, and an engine left open when the interpreter exits. A tensor-parallel
engine's rank-1 worker used to live until exit, then log a false ERROR for the exit's SIGTERM; an
engine-core process left running made the interpreter wait for it for ever."""

from __future__ import annotations

import gc
import pathlib
import subprocess
import sys

import pytest
from corral_engine import AsyncEngine, EngineArgs, SamplingParams
from corral_engine.errors import EngineDeadError

from tests.engine.helpers import make_engine

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _children() -> set[int]:
    """This process's child processes (of any of its threads), but multiprocessing's resource
    tracker, which spawn starts once and keeps."""
    pids = set()
    for children in pathlib.Path("/proc/self/task").glob("*/children"):
        pids |= {int(pid) for pid in children.read_text().split()}
    return {pid for pid in pids if b"resource_tracker" not in _cmdline(pid)}


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return b"resource_tracker"


@pytest.mark.slow
def test_a_closed_tensor_parallel_engine_leaves_no_process(tiny_model_dir: pathlib.Path) -> None:
    before = _children()
    with make_engine(tiny_model_dir, tensor_parallel_size=2, max_model_len=64) as engine:
        assert len(engine.generate("hello", GREEDY)[0].outputs[0].token_ids) == 3
        assert len(_children() - before) == 1  # the rank-1 worker
    assert _children() - before == set()
    assert engine.is_closed
    engine.close()  # again: nothing left to do
    with pytest.raises(EngineDeadError, match="the engine is closed"):
        engine.generate("hello", GREEDY)


@pytest.mark.slow
def test_a_collected_tensor_parallel_engine_stops_its_worker(tiny_model_dir: pathlib.Path) -> None:
    before = _children()
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2, max_model_len=64)
    assert len(_children() - before) == 1
    del engine
    gc.collect()
    assert _children() - before == set()


def test_close_aborts_what_is_unfinished_and_frees_the_model(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, max_model_len=64)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=20))
    engine.step()
    engine.close()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not hasattr(engine.runner, "model") and engine.runner.kv_caches == []
    assert engine.step() == []


async def test_async_with_starts_and_shuts_down(tiny_model_dir: pathlib.Path) -> None:
    args = EngineArgs(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    async with AsyncEngine(args) as engine:
        assert engine.is_running
        outputs = [out async for out in engine.add_request("r", "hello", GREEDY)]
        out = outputs[-1]
        assert out.finished and len(out.outputs[0].token_ids) == 3
    assert not engine.is_running and engine.engine.is_closed
    await engine.close()  # again: nothing left to do
    with pytest.raises(EngineDeadError):
        engine.add_request("again", "hello", GREEDY)


_LEFT_OPEN = """
import logging, sys
from corral_engine import {cls}, EngineArgs, SamplingParams

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    engine = {cls}(EngineArgs(model=sys.argv[1], dtype="float32", num_kv_blocks=64, {extra}))
    {use}
    print("leaving it open")
"""


def _exit_with_open_engine(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, cls: str, extra: str, use: str
) -> str:
    script = tmp_path / "left_open.py"
    script.write_text(_LEFT_OPEN.format(cls=cls, extra=extra, use=use))
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "leaving it open" in done.stdout
    return done.stderr


@pytest.mark.slow
def test_exit_with_an_open_tensor_parallel_engine_logs_no_error(
    tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path
) -> None:
    use = 'engine.generate("hello", SamplingParams(max_tokens=2))'
    stderr = _exit_with_open_engine(tmp_path, tiny_model_dir, "LLMEngine", "tensor_parallel_size=2", use)
    assert "ERROR" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_exit_with_a_running_engine_core_does_not_wait_for_it(
    tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path
) -> None:
    use = "import asyncio; asyncio.run(engine.start())"
    stderr = _exit_with_open_engine(tmp_path, tiny_model_dir, "EngineCoreClient", "", use)
    assert "ERROR" not in stderr and "Traceback" not in stderr, stderr
