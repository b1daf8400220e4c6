"""Finds the e2e Kubernetes binaries, building them with build.sh when the cache is cold."""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BUILD_SCRIPT = Path(__file__).with_name("build.sh")
_EXIT_NO_GO = 3
# A cold build of kube-apiserver and friends on two shared cores takes tens of minutes.
_BUILD_TIMEOUT_S = 3 * 60 * 60

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")


class ToolchainUnavailable(RuntimeError):
    """The binaries cannot be built on this machine (no Go); the k8s tests skip with this reason."""


class ToolchainBuildError(RuntimeError):
    """Go is there but the build failed: a real failure, never a skip."""


@dataclass(frozen=True, slots=True)
class Toolchain:
    bin_dir: Path

    @property
    def kwok_stages(self) -> Path:
        return self.bin_dir.parent / "kwok-stages.yaml"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name


def is_toolchain_cached() -> bool:
    if shutil.which("go") is None:
        return False
    result = subprocess.run(["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, check=False)
    return result.returncode == 0


def start_background_build(log_path: Path) -> subprocess.Popen[bytes]:
    """Starts build.sh in the background so a cold build overlaps other tests.

    ensure_toolchain() later waits for it (build.sh serialises builds with a lock file). The caller
    must stop the returned process if the session ends first.
    """
    with log_path.open("wb") as log:
        return subprocess.Popen(
            ["bash", str(BUILD_SCRIPT)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )


def ensure_toolchain() -> Toolchain:
    """Runs build.sh (a no-op when cached) and returns where the binaries are.

    build.sh prints its progress on stderr, which is passed through so a cold build is visible.
    """
    if shutil.which("go") is None:
        raise ToolchainUnavailable(
            "the go command is not installed, so the Kubernetes e2e toolchain cannot be built"
        )
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        timeout=_BUILD_TIMEOUT_S,
    )
    if result.returncode == _EXIT_NO_GO:
        raise ToolchainUnavailable("build.sh found no usable go command")
    if result.returncode != 0:
        raise ToolchainBuildError(f"{BUILD_SCRIPT} failed with exit code {result.returncode}")
    lines = result.stdout.strip().splitlines()
    if not lines:
        raise ToolchainBuildError(f"{BUILD_SCRIPT} printed no bin directory")
    toolchain = Toolchain(bin_dir=Path(lines[-1]))
    missing = [name for name in BINARIES if not toolchain.binary(name).is_file()]
    if missing or not toolchain.kwok_stages.is_file():
        raise ToolchainBuildError(f"{toolchain.bin_dir} lacks {missing or 'kwok-stages.yaml'}")
    logger.info("Kubernetes e2e toolchain in %s", toolchain.bin_dir)
    return toolchain
