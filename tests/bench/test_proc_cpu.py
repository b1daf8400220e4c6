"""bench/engine/proc_cpu.py: a process tree's CPU per thread between two /proc snapshots."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bench.engine import proc_cpu

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_child_and_thread_are_counted_and_the_main_thread_apart() -> None:
    # A child process that burns ~0.3 s of CPU on a thread of its own and little on its main thread.
    # The thread stays alive until the end: /proc keeps no record of a thread that exited.
    code = (
        "import sys, threading, time\n"
        "spun, leave = threading.Event(), threading.Event()\n"
        "def spin():\n"
        "    end = time.thread_time() + 0.3\n"
        "    while time.thread_time() < end: pass\n"
        "    spun.set(); leave.wait()\n"
        "sys.stdin.readline()\n"
        "t = threading.Thread(target=spin); t.start(); spun.wait()\n"
        "print('done', flush=True)\n"
        "sys.stdin.readline(); leave.set()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(0.2)  # past the interpreter's start-up
        me = os.getpid()
        before = proc_cpu.snapshot(me)
        assert any(pid == child.pid for pid, _ in before)  # the child is in this process's tree
        _spin(0.2)  # this process's main thread: the "event loop" of the tree
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        after = proc_cpu.snapshot(me)
    finally:
        child.kill()
        child.wait()
    d = proc_cpu.delta(before, after, me, num_busiest=1)
    assert d is not None
    assert d["main_thread"]["cpu_s"] == pytest.approx(0.2, abs=0.08)
    (busiest,) = d["busiest"]
    assert busiest["cpu_s"] == pytest.approx(0.3, abs=0.08)  # the child's spinning thread
    assert d["cpu_s"] >= d["main_thread"]["cpu_s"] + busiest["cpu_s"] - 0.02
    assert d["num_processes"] >= 2
    line = proc_cpu.describe(d, output_tokens=1000, client_cpu_s=0.05)
    assert "client 50 µs/token" in line and "busiest 1 threads" in line


def test_a_thread_started_during_the_run_counts_whole() -> None:
    me = os.getpid()
    before = proc_cpu.snapshot(me)
    spun, leave = threading.Event(), threading.Event()

    def work() -> None:
        _spin(0.2)
        spun.set()
        leave.wait()

    worker = threading.Thread(target=work)
    worker.start()
    try:
        spun.wait()
        after = proc_cpu.snapshot(me)
    finally:
        leave.set()
        worker.join()
    assert worker.native_id is not None and (me, worker.native_id) not in before
    assert after[(me, worker.native_id)].cpu_s == pytest.approx(0.2, abs=0.08)
    d = proc_cpu.delta(before, after, me, num_busiest=1)
    assert d is not None and d["busiest"][0]["cpu_s"] == pytest.approx(0.2, abs=0.08)


def test_nothing_to_tell_gives_no_summary() -> None:
    assert proc_cpu.delta({}, {}, os.getpid()) is None
