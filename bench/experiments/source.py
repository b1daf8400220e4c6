"""Which engine code the experiments run: the working tree, or a git revision unpacked aside.

A revision keeps a long run consistent while the working tree changes under it: its `engine/`
and `cli/` are extracted to a directory put first on the engine processes' PYTHONPATH (ahead of
the editable install, whose finder Python consults after sys.path).
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_PACKAGES = ("engine", "cli")


@dataclass(frozen=True, slots=True)
class EngineSource:
    description: str  # e.g. "git 1a2b3c4" or "working tree at 1a2b3c4 (uncommitted engine changes)"
    env: dict[str, str] | None = None  # extra environment for engine processes


def _git(*argv: str) -> bytes:
    result = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, check=False)
    if result.returncode != 0:
        raise ValueError(f"git {' '.join(argv)}: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def working_tree() -> EngineSource:
    try:
        head = _git("rev-parse", "--short", "HEAD").decode().strip()
        is_dirty = bool(_git("status", "--porcelain", "--", *_PACKAGES).strip())
    except (OSError, ValueError):
        return EngineSource("working tree (not a git checkout)")
    return EngineSource(f"working tree at {head}" + (" (uncommitted engine changes)" if is_dirty else ""))


def from_revision(rev: str, into: Path) -> EngineSource:
    """`engine/` and `cli/` as of `rev`, unpacked under `into`; ValueError if git cannot."""
    sha = _git("rev-parse", "--short", f"{rev}^{{commit}}").decode().strip()
    archive = _git("archive", "--format=tar", sha, *_PACKAGES)
    target = into / f"src-{sha}"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    path = ":".join(str(target / p) for p in _PACKAGES)
    return EngineSource(f"git {sha}", {"PYTHONPATH": path})
