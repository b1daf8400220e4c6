"""Where a served run's CPU went, per thread, read from /proc (Linux).

A served engine shares the machine's cores with its own HTTP front and, in these benchmarks, with
the load generator. One snapshot of the server's process tree before a `corral bench` run and one
after give each thread's CPU time (`stat`: user + system) and its time spent runnable but waiting
for a core (`schedstat`'s second field: what other work on the same cores cost it). The summary
names the thread that runs the top process's event loop (its main thread, in Corral's and vLLM's
API servers alike) and, apart, the busiest threads (the engine's step thread and its OpenMP
workers). A thread that exits between the two snapshots is not counted (/proc keeps nothing of
it); the servers measured here keep theirs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True, slots=True)
class ThreadTimes:
    pid: int
    name: str
    cpu_s: float
    runqueue_s: float  # runnable, waiting for a core


Snapshot = dict[tuple[int, int], ThreadTimes]  # (pid, tid) -> times


def stat_cpu_s(stat_path: Path) -> float:
    """User + system CPU seconds from a Linux /proc `stat` file (a process's or a thread's)."""
    return _parse_stat(stat_path.read_text())[1]


def _parse_stat(text: str) -> tuple[str, float]:
    """A `stat` file's command name and user + system CPU seconds."""
    fields = text[text.rindex(")") + 2 :].split()
    return text[text.index("(") + 1 : text.rindex(")")], (int(fields[11]) + int(fields[12])) * _TICK_S


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (each thread's `children` file names the processes it
    started)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            tasks = os.listdir(PROC / str(p) / "task")
        except OSError:  # gone meanwhile
            continue
        for tid in tasks:
            try:
                todo.extend(int(c) for c in (PROC / str(p) / "task" / tid / "children").read_text().split())
            except OSError:
                continue
    return found


def _thread(pid: int, tid: int) -> ThreadTimes | None:
    task = PROC / str(pid) / "task" / str(tid)
    try:
        name, cpu_s = _parse_stat((task / "stat").read_text())
        schedstat = (task / "schedstat").read_text().split()
    except OSError:  # gone meanwhile, or no schedstat in this kernel
        return None
    return ThreadTimes(pid, name, cpu_s, int(schedstat[1]) / 1e9)


def snapshot(pid: int) -> Snapshot:
    """Every thread of `pid`'s process tree now; empty where /proc cannot tell (not Linux)."""
    snap: Snapshot = {}
    if not PROC.is_dir():
        return snap
    for p in _descendants(pid):
        try:
            tids = [int(t) for t in os.listdir(PROC / str(p) / "task")]
        except OSError:
            continue
        for tid in tids:
            times = _thread(p, tid)
            if times is not None:
                snap[(p, tid)] = times
    return snap


def delta(before: Snapshot, after: Snapshot, pid: int, num_busiest: int = 2) -> dict[str, Any] | None:
    """The run's CPU between two snapshots of `pid`'s tree: in all, on the top process's main thread
    (the event loop), on the `num_busiest` busiest threads, and waiting for a core."""
    if not after:
        return None
    used: list[tuple[float, float, tuple[int, int], str]] = []
    for key, a in after.items():
        b = before.get(key)
        cpu = a.cpu_s - (b.cpu_s if b else 0.0)
        wait = a.runqueue_s - (b.runqueue_s if b else 0.0)
        used.append((cpu, wait, key, a.name))
    main = [(cpu, wait) for cpu, wait, key, _ in used if key == (pid, pid)]
    busiest = sorted((u for u in used if u[2] != (pid, pid)), key=lambda u: -u[0])[:num_busiest]
    return {
        "cpu_s": sum(u[0] for u in used),
        "runqueue_s": sum(u[1] for u in used),
        "main_thread": {"cpu_s": main[0][0], "runqueue_s": main[0][1]} if main else None,
        "busiest": [{"name": name, "cpu_s": cpu, "runqueue_s": wait} for cpu, wait, _, name in busiest],
        "num_processes": len({key[0] for key in after}),
    }


def describe(d: dict[str, Any], output_tokens: int, client_cpu_s: float | None) -> str:
    """One line: µs of CPU per output token on the event loop, the busiest threads and the client,
    and the busiest threads' wait for a core."""

    def per_token(seconds: float) -> str:
        return f"{1e6 * seconds / output_tokens:.0f} µs/token" if output_tokens else "-"

    main = d.get("main_thread")
    parts = [f"server {d['cpu_s']:.2f} s CPU"]
    if main is not None:
        parts.append(f"main thread {per_token(main['cpu_s'])}")
    busy = d.get("busiest") or []
    if busy:
        parts.append(
            f"busiest {len(busy)} threads {sum(t['cpu_s'] for t in busy):.2f} s CPU, "
            f"{sum(t['runqueue_s'] for t in busy):.2f} s waiting for a core"
        )
    if client_cpu_s is not None:
        parts.append(f"client {per_token(client_cpu_s)}")
    return "; ".join(parts)
