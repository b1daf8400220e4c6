"""What the phases of one GPU run share: its sizes (full GPU run or CPU smoke run), the demo
checkpoints it builds once, and the one engine it keeps alive at a time.

Engine options that not every engine revision has (attention_backend, enforce_eager,
gpu_memory_utilization) are passed only where `EngineArgs` declares them, and every engine records
the values it ran with.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from corral_engine.args import EngineArgs
from corral_engine.demo_model import write_demo_model
from corral_engine.llm_engine import LLMEngine

log = logging.getLogger("gpu")

GPU_OPTIONS = ("attention_backend", "enforce_eager", "gpu_memory_utilization")
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Profile:
    """The sizes of a run. GPU: the issue's shapes; smoke: the same code on CPU in seconds."""

    device: str
    dtype: str  # the speed phases' weights and KV (equality runs in float32)
    equality_prompts: int
    equality_new_tokens: int
    batch1_preset: str
    batch1_prompt_len: int
    batch1_warmup_tokens: int
    batch1_tokens: int
    overhead_batches: tuple[int, ...]
    overhead_prompt_len: int
    overhead_steps: int
    throughput_preset: str
    quick_workloads: bool  # bench/engine's --quick sizes (fewer, shorter requests)
    hf_batch_sizes: dict[str, tuple[int, ...]]
    hf_budget_s: float | None  # per workload and batch size; a static run past it reports its pace
    hf_cb_warmup: bool  # transformers' continuous-batching warm-up (CUDA graph capture; ~30 s on CPU)
    # its paged cache in blocks of 256 tokens; None: sized from free memory (13 GB on CPU: ~20 s)
    hf_cb_num_blocks: int | None
    bandwidth_bytes: int
    bandwidth_repeats: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # KV cache for the speed phases where the engine has no gpu_memory_utilization (else: its default)
    kv_cache_bytes: int | None
    num_threads: int | None  # torch CPU threads (smoke: one, so a busy second core does not stall it)
    served_rates: tuple[float, ...]  # the served phase's Poisson arrival rates, requests a second
    served_requests: int  # how many of W2's requests it sends at each rate
    lora_steps: int  # the lora phase's timed decode steps per arm and batch (overhead_batches)
    quant_preset: str  # the quant phase's agreement checkpoint (its speed runs on batch1_preset)
    quant_prompts: int
    quant_new_tokens: int  # greedy tokens compared per prompt
    quant_steps: int  # timed decode steps per arm and batch (overhead_batches)
    quant_budget_s: float | None  # W2 throughput runs only while the phase is within this


GPU = Profile(
    device="cuda",
    dtype="bfloat16",
    equality_prompts=8,
    equality_new_tokens=32,
    batch1_preset="llama3-8b",
    batch1_prompt_len=128,
    batch1_warmup_tokens=16,
    batch1_tokens=256,
    overhead_batches=(1, 64),
    overhead_prompt_len=128,
    overhead_steps=20,
    throughput_preset="llama3-8b",
    quick_workloads=False,
    hf_batch_sizes={"W1": (32, 64), "W2": (64, 128)},
    hf_budget_s=150.0,
    hf_cb_warmup=True,
    hf_cb_num_blocks=None,
    bandwidth_bytes=4 * _GIB,
    bandwidth_repeats=20,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    kv_cache_bytes=24 * _GIB,
    num_threads=None,
    served_rates=(10.0, 20.0),  # W2 offline on an H200: ~4,700 tok/s, ~30 of its requests a second
    served_requests=200,
    lora_steps=50,
    quant_preset="small",
    quant_prompts=4,
    quant_new_tokens=32,
    quant_steps=50,
    quant_budget_s=120.0,
)
SMOKE = Profile(
    device="cpu",
    dtype="float32",
    equality_prompts=3,
    equality_new_tokens=8,
    batch1_preset="tiny",
    batch1_prompt_len=32,
    batch1_warmup_tokens=4,
    batch1_tokens=16,
    overhead_batches=(1, 8),
    overhead_prompt_len=32,
    overhead_steps=3,
    throughput_preset="tiny",
    quick_workloads=True,
    hf_batch_sizes={"W1": (8,), "W2": (4, 12)},
    hf_budget_s=None,
    hf_cb_warmup=False,
    hf_cb_num_blocks=64,
    bandwidth_bytes=64 << 20,
    bandwidth_repeats=5,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    kv_cache_bytes=None,
    num_threads=1,
    served_rates=(50.0,),
    served_requests=6,
    lora_steps=3,
    quant_preset="tiny",
    quant_prompts=2,
    quant_new_tokens=8,
    quant_steps=3,
    quant_budget_s=None,
)


def engine_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(EngineArgs)}


@dataclass(slots=True)
class Run:
    """One invocation: its profile, where checkpoints go, and the engine currently alive."""

    profile: Profile
    models_dir: Path
    device: torch.device = field(init=False)
    _engine: LLMEngine | None = None
    _engine_key: str = ""
    _engine_record: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.profile.device)

    # -- checkpoints ----------------------------------------------------------------------------
    def model_dir(self, preset: str, arch: str = "llama") -> Path:
        """The demo checkpoint, written once per models_dir (a marker says it is complete). Tiny
        ones are drawn on CPU (the same bytes as CI's); larger ones on the run's device."""
        path = self.models_dir / f"{preset}-{arch}-seed0"
        marker = path.with_name(path.name + ".complete")
        if marker.is_file():
            return path
        shutil.rmtree(path, ignore_errors=True)
        device = "cpu" if preset == "tiny" else self.profile.device
        log.info("writing the %s %s checkpoint to %s (weights drawn on %s)", preset, arch, path, device)
        t0 = time.perf_counter()
        write_demo_model(path, preset=preset, arch=arch, device=device)
        log.info("wrote %s in %.1f s", path.name, time.perf_counter() - t0)
        marker.write_text(json.dumps({"preset": preset, "arch": arch, "seed": 0, "device": device}))
        return path

    # -- engines --------------------------------------------------------------------------------
    def equality_options(self) -> dict[str, Any]:
        """The equality phase's engine: float32 like the reference, a small fixed KV cache."""
        options: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 256}
        if self.profile.num_threads is not None:
            options["num_threads"] = self.profile.num_threads
        return options

    def speed_options(self) -> dict[str, Any]:
        """The speed phases' engine: the engine's default GPU settings, with room for W2's 200
        requests; a fixed KV budget only where the engine cannot size it from the card."""
        options: dict[str, Any] = {
            "dtype": self.profile.dtype,
            "max_num_seqs": self.profile.max_num_seqs,
            "max_num_batched_tokens": self.profile.max_num_batched_tokens,
        }
        if self.profile.kv_cache_bytes is not None and "gpu_memory_utilization" not in engine_fields():
            options["kv_cache_memory_bytes"] = self.profile.kv_cache_bytes
        if self.profile.num_threads is not None:
            options["num_threads"] = self.profile.num_threads
        return options

    def engine(self, model_dir: Path, **options: Any) -> tuple[LLMEngine, dict[str, Any]]:
        """An engine for `model_dir` with `options` (those EngineArgs lacks are dropped and listed);
        the live one when it matches, else the live one is released first."""
        key = json.dumps([str(model_dir), sorted(options.items())], default=str)
        if self._engine is not None and key == self._engine_key:
            return self._engine, self._engine_record
        self.release()
        fields = engine_fields()
        given = {k: v for k, v in options.items() if k in fields}
        args = EngineArgs(model=str(model_dir), device=self.profile.device, **given)
        log.info("starting an engine on %s with %s", model_dir.name, given)
        t0 = time.perf_counter()
        self._engine = LLMEngine(args)
        record = {
            "model": model_dir.name,
            "options": {k: getattr(args, k) for k in sorted({*given, *GPU_OPTIONS} & fields)},
            "not_in_engine_args": sorted(set(options) - fields),
            "num_kv_blocks": self._engine.block_manager.num_blocks,
            "start_s": time.perf_counter() - t0,
        }
        log.info("engine up in %.1f s: %s", record["start_s"], record)
        self._engine_key, self._engine_record = key, record
        return self._engine, record

    def release(self) -> None:
        """Drop the live engine and give its device memory back (before another one, or transformers)."""
        if self._engine is None:
            return
        self._engine, self._engine_key, self._engine_record = None, "", {}
        free_memory(self.device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        log.info(
            "device memory after release: %.2f GiB allocated", torch.cuda.memory_allocated(device) / _GIB
        )
