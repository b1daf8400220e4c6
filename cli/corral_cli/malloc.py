"""Memory settings for engine processes on CPU: tcmalloc and transparent huge pages.

PyTorch on the CPU allocates and frees every activation through the C allocator, many times per
step. With tcmalloc preloaded instead of glibc's malloc the engine's batched decode ran 6-10%
faster (small preset, bf16, 2 cores; docs/engine-speed.md, item 9), the same advice vLLM's CPU
build gives. It must be in LD_PRELOAD when the process starts, so `corral up` sets it for the
engines it starts, the engine image sets it in its environment, and `corral engine` says when it
runs without it. `CORRAL_TCMALLOC=0` turns the preload off.

PyTorch's `THP_MEM_ALLOC_ENABLE=1` puts tensors of 2 MiB or more on 2 MiB transparent huge pages
(madvise). On glibc's malloc, which maps large activations afresh every step, batched decode ran
~1.05-1.08x faster with it; with tcmalloc, which keeps its memory, it made no difference
(docs/engine-speed.md, item 12). It costs nothing measurable, so engines get it either way:
PyTorch reads it once, at its first allocation, so `corral engine` sets it before importing torch
unless it is set, and `engine_env` and the engine image set it too. It needs the kernel's THP mode
to be `madvise` or `always` (/sys/kernel/mm/transparent_hugepage/enabled); under `never` it does
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

ENV_SWITCH = "CORRAL_TCMALLOC"
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
# Where distributions put it (Debian/Ubuntu multiarch, Fedora/RHEL, the engine image's link).
LIB_DIRS = (
    Path("/usr/local/lib"),
    Path("/usr/lib/x86_64-linux-gnu"),
    Path("/usr/lib/aarch64-linux-gnu"),
    Path("/usr/lib64"),
    Path("/usr/lib"),
)
# tcmalloc reports every allocation over 1 GiB on stderr by default; loading weights makes some.
_REPORT_THRESHOLD = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's switch: tensors of 2 MiB+ on transparent huge pages
THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def find_tcmalloc(dirs: Iterable[Path] | None = None) -> Path | None:
    """The first tcmalloc shared library installed in `dirs` (default LIB_DIRS; Debian's package
    is libtcmalloc-minimal4)."""
    for directory in LIB_DIRS if dirs is None else dirs:
        for name in NAMES:
            if (directory / name).is_file():
                return directory / name
    return None


def engine_env(env: Mapping[str, str], dirs: Iterable[Path] | None = None) -> dict[str, str]:
    """`env` for an engine process: tensors on huge pages unless `THP_MEM_ALLOC_ENABLE` says
    otherwise, and tcmalloc added to LD_PRELOAD when it is installed, not already preloaded and not
    switched off."""
    out = dict(env)
    out.setdefault(THP_ENV, "1")
    preload = out.get("LD_PRELOAD", "")
    if out.get(ENV_SWITCH, "auto") == "0" or "tcmalloc" in preload:
        return out
    library = find_tcmalloc(dirs)
    if library is None:
        return out
    out["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    out.setdefault(_REPORT_THRESHOLD, str(1 << 40))
    return out


def is_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether tcmalloc is mapped into this process (so it is the allocator)."""
    try:
        return "tcmalloc" in maps.read_text()
    except OSError:
        return False


def advice(loaded: bool, library: Path | None) -> tuple[int, str]:
    """What `corral engine` logs about its allocator on CPU: (logging level, message)."""
    if loaded:
        return logging.INFO, "memory allocator: tcmalloc (preloaded)"
    if library is not None:
        return logging.WARNING, (
            f"tcmalloc is installed but not preloaded: start the engine with LD_PRELOAD={library} for "
            "6-10% more batched throughput on CPU (corral up and the engine image do this)"
        )
    return logging.INFO, (
        "memory allocator: glibc malloc; with tcmalloc installed (Debian: libtcmalloc-minimal4) and "
        "preloaded, batched decode on CPU runs 6-10% faster"
    )


def thp_mode(path: Path = THP_SYSFS) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_advice(setting: str | None, mode: str | None) -> tuple[int, str]:
    """What `corral engine` logs about huge pages on CPU: (logging level, message)."""
    if setting != "1":
        return logging.INFO, f"tensors on 4 KiB pages ({THP_ENV}={setting or 'unset'})"
    if mode == "never":
        return logging.INFO, (
            "tensors on 4 KiB pages: the kernel's transparent huge pages are off (never); "
            "`madvise` or `always` helps when the engine runs on glibc's malloc"
        )
    return logging.INFO, f"tensors of 2 MiB+ on transparent huge pages (kernel mode: {mode or 'unknown'})"
