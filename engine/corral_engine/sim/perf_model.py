"""Step-time models for the simulated engine: a roofline from a GPU's FLOP/s and memory bandwidth,
or a linear fit to measured step times (no torch; numpy only for fitting).

A step's cost depends on the batch the scheduler chose: how many tokens it computes, how many
sequences it holds, how much KV their attention reads, and how many query-key pairs it scores.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from corral_engine.args import OPTIONS
from corral_engine.core.scheduler import ScheduledSeq


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes; every step-time model reads only this."""

    num_tokens: int  # new tokens computed (prefill chunks + one per decode)
    num_seqs: int
    num_kv_tokens: int  # KV entries attention reads: sum over sequences of their context after the step
    num_attn_pairs: float  # query-key pairs scored (causal within a chunk)

    @classmethod
    def of(cls, scheduled: Iterable[ScheduledSeq]) -> StepShape:
        num_tokens = num_seqs = num_kv = 0
        pairs = 0.0
        for s in scheduled:
            new = s.num_new_tokens
            num_tokens += new
            num_seqs += 1
            num_kv += s.start + new
            pairs += new * (s.start + (new + 1) / 2)
        return cls(num_tokens, num_seqs, num_kv, pairs)

    def features(self) -> list[float]:
        """The fitted model's regressors, constant first."""
        return [
            1.0,
            float(self.num_seqs),
            float(self.num_tokens),
            float(self.num_kv_tokens),
            self.num_attn_pairs,
        ]


class StepTimeModel(Protocol):
    def step_time_s(self, shape: StepShape) -> float: ...


# Weight quantizations a simulated replica models: the engine's --quantization fp8|int8 store the
# dense layers' projections at 1 byte a parameter; int4 checkpoints (AWQ, GPTQ, compressed-tensors
# W4A16) at half a byte plus a 16-bit scale and zero per group of 128 inputs, multiplied in bf16.
QUANTIZATIONS = ("fp8", "int8", "int4")
QUANTIZED_BYTES_PER_PARAM = {"fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / 128}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A transformer's shape, as much as its cost needs."""

    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # the model dtype (bf16): KV cache, activations, unquantized weights
    # Input embedding and lm_head: they stay in the model dtype when the projections are quantized.
    embedding_params: float = 0.0
    quantization: str | None = None  # fp8, int8 (1 byte a projection weight) or int4 (~0.53)
    kv_bytes_per_element: int | None = None  # --kv-cache-dtype fp8: 1; None: bytes_per_param

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )

    @property
    def num_projection_params(self) -> float:
        """The layers' weights (norms, a rounding error, counted with them)."""
        return self.num_params - self.embedding_params

    @property
    def weight_bytes(self) -> float:
        if self.quantization is None:
            return self.num_params * self.bytes_per_param
        return (
            self.num_projection_params * QUANTIZED_BYTES_PER_PARAM[self.quantization]
            + self.embedding_params * self.bytes_per_param
        )

    @property
    def kv_bytes_per_token(self) -> int:
        element = self.kv_bytes_per_element or self.bytes_per_param
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    peak_flops: float  # dense bf16, per GPU
    memory_bandwidth_bytes_s: float
    memory_bytes: float
    link_bandwidth_bytes_s: float = 450e9  # NVLink, one direction, for tensor-parallel all-reduces
    compute_capability: tuple[int, int] = (8, 0)

    @property
    def has_fp8_tensor_cores(self) -> bool:
        """sm >= 8.9 (Ada, Hopper and later): dense FP8 matmuls at twice the bf16 peak."""
        return self.compute_capability >= (8, 9)


@dataclass(frozen=True, slots=True)
class Roofline:
    """max(compute time, memory time) + fixed costs. Efficiencies are the share of peak that real
    kernels reach (vLLM-class engines: ~0.6 of FLOP/s in prefill, ~0.85 of bandwidth in decode)."""

    gpu: Gpu
    model: ModelShape
    num_gpus: int = 1  # tensor parallel
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.85
    step_overhead_s: float = 1.0e-3  # scheduling, launches (CUDA graphs), sampling
    seq_overhead_s: float = 10e-6  # per sequence in the batch (inputs, outputs, detokenizing)
    allreduce_latency_s: float = 8e-6

    def step_time_s(self, shape: StepShape) -> float:
        m = self.model
        flops = (
            2 * m.num_params * shape.num_tokens
            + 4 * m.num_layers * m.num_heads * m.head_dim * shape.num_attn_pairs
        )
        if self.has_fp8_matmuls:  # the projections' 2 FLOPs a parameter a token at twice the peak
            flops -= m.num_projection_params * shape.num_tokens
        mem_bytes = m.weight_bytes + m.kv_bytes_per_token * (shape.num_kv_tokens + shape.num_tokens)
        compute_s = flops / (self.num_gpus * self.gpu.peak_flops * self.compute_efficiency)
        memory_s = mem_bytes / (self.num_gpus * self.gpu.memory_bandwidth_bytes_s * self.bandwidth_efficiency)
        comm_s = 0.0
        if self.num_gpus > 1:  # two all-reduces of the activations per layer
            volume = shape.num_tokens * m.hidden_size * m.bytes_per_param
            comm_s = 2 * m.num_layers * (self.allreduce_latency_s + volume / self.gpu.link_bandwidth_bytes_s)
        return self.step_overhead_s + self.seq_overhead_s * shape.num_seqs + max(compute_s, memory_s) + comm_s

    @property
    def has_fp8_matmuls(self) -> bool:
        """fp8 weights on FP8 tensor cores run W8A8 (dynamic activation scales); int8 weights, and
        fp8 ones on older GPUs, are dequantized and multiplied in the model dtype."""
        return self.model.quantization == "fp8" and self.gpu.has_fp8_tensor_cores

    def num_kv_blocks(self, block_size: int, memory_utilization: float = 0.9) -> int:
        """KV blocks in what the GPUs' memory holds beyond the weights and ~2 GiB of activations each."""
        budget = (
            self.num_gpus * (self.gpu.memory_bytes * memory_utilization - 2 * 2**30) - self.model.weight_bytes
        )
        return max(1, int(budget // (self.model.kv_bytes_per_token * block_size)))


@dataclass(frozen=True, slots=True)
class Fitted:
    """t = c0 + c_seq * seqs + c_tok * tokens + c_kv * kv tokens + c_attn * attention pairs."""

    coefficients: tuple[float, float, float, float, float]

    def step_time_s(self, shape: StepShape) -> float:
        return max(0.0, sum(c * f for c, f in zip(self.coefficients, shape.features(), strict=True)))

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], times_s: Sequence[float]) -> Fitted:
        """Least squares with non-negative coefficients (a regressor that fits negative is dropped
        and the rest refitted), so the model never predicts that more work takes less time."""
        import numpy as np

        x = np.array([s.features() for s in shapes], dtype=np.float64)
        y = np.array(times_s, dtype=np.float64)
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns span ~10 orders of magnitude
        active = list(range(x.shape[1]))
        coef = np.zeros(x.shape[1])
        while active:
            sol, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
            coef[:] = 0.0
            coef[active] = sol / scale[active]
            negative = [i for i in active if coef[i] < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: coef[i] * scale[i]))
        c0, c1, c2, c3, c4 = (float(c) for c in coef)
        return cls((c0, c1, c2, c3, c4))


@dataclass(frozen=True, slots=True)
class Profile:
    """A simulated replica: how long its steps take and how its scheduler is sized."""

    name: str
    model: Roofline | Fitted
    num_kv_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    block_size: int = 16
    # K and V bytes of one token on each GPU (per rank, as the engine reads --kv-cache-memory), for
    # a fitted profile: `corral calibrate` records its engine's; None where unknown. A roofline
    # profile works it out from its model and GPUs instead.
    kv_bytes_per_token: int | None = None

    def step_time_s(self, shape: StepShape) -> float:
        return self.model.step_time_s(shape)

    def gpu_kv_bytes_per_token(self) -> int | None:
        """K and V bytes of one token on each GPU (each rank holds its share of the KV heads), or
        None when the profile does not know them."""
        if isinstance(self.model, Roofline):
            return self.model.model.kv_bytes_per_token // self.model.num_gpus
        return self.kv_bytes_per_token

    def num_kv_blocks_in(self, kv_bytes_per_gpu: int) -> int | None:
        """KV blocks of this profile's size in `kv_bytes_per_gpu` on each GPU, as the engine reads
        --kv-cache-memory (0 when not one fits), or None when a token's KV bytes are unknown."""
        per_token = self.gpu_kv_bytes_per_token()
        return None if per_token is None else kv_bytes_per_gpu // (per_token * self.block_size)

    def to_json(self) -> dict[str, Any]:
        if not isinstance(self.model, Fitted):
            raise ValueError("only fitted profiles are written to files; roofline ones are built in")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        return {**out, "kind": "fitted", "coefficients": list(self.model.coefficients)}


# Embeddings: untied input embedding and lm_head, 128,256 x hidden each.
LLAMA3_8B = ModelShape(8.03e9, 32, 4096, 32, 8, 128, embedding_params=2 * 128_256 * 4096)
LLAMA3_70B = ModelShape(70.6e9, 80, 8192, 64, 8, 128, embedding_params=2 * 128_256 * 8192)
# BGE-large-en-v1.5 (BERT-large): an encoder embedding model; its word, position and type embeddings.
BGE_LARGE = ModelShape(335e6, 24, 1024, 16, 16, 64, embedding_params=(30_522 + 512 + 2) * 1024)
H100 = Gpu("H100-SXM-80GB", 989e12, 3.35e12, 80e9, compute_capability=(9, 0))
A100 = Gpu("A100-SXM-80GB", 312e12, 2.039e12, 80e9, link_bandwidth_bytes_s=300e9, compute_capability=(8, 0))


def quantized(profile: Profile, quantization: str) -> Profile:
    """A roofline profile with its projections' weights quantized (fp8, int8: 1 byte a parameter,
    as --quantization loads them; int4: an int4 checkpoint's ~0.53): its KV cache re-sized from the
    memory the smaller weights leave, at the built-in profiles' --gpu-memory-utilization 0.9
    (raises ValueError for a fitted profile: its step times were measured with the weights it had).
    fp8 on a GPU without FP8 matmuls changes nothing."""
    if not isinstance(profile.model, Roofline):
        raise ValueError(f"{profile.name} is a fitted profile; only a roofline profile can be quantized")
    if profile.model.model.quantization == quantization:
        return profile
    if quantization == "fp8" and not profile.model.gpu.has_fp8_tensor_cores:
        return profile  # the engine dequantizes fp8 weights at load below sm 8.9: bf16 as before
    model = dataclasses.replace(profile.model.model, quantization=quantization)
    roofline = dataclasses.replace(profile.model, model=model)
    name = f"{profile.name}-{quantization}"
    return dataclasses.replace(
        profile, name=name, model=roofline, num_kv_blocks=roofline.num_kv_blocks(profile.block_size)
    )


def with_kv_cache_dtype(profile: Profile, kv_cache_dtype: str) -> Profile:
    """A roofline profile whose KV cache is in `kv_cache_dtype` (--kv-cache-dtype): fp8 ones hold a
    token's keys and values in half of bf16's bytes, so twice the blocks fit and decode steps read
    half the KV bytes; "auto" changes nothing (raises ValueError for a fitted profile)."""
    if not isinstance(profile.model, Roofline):
        raise ValueError(f"{profile.name} is a fitted profile: its KV cache is the one it was measured with")
    if not kv_cache_dtype.startswith("fp8"):
        return profile
    model = dataclasses.replace(profile.model.model, kv_bytes_per_element=1)
    roofline = dataclasses.replace(profile.model, model=model)
    return dataclasses.replace(
        profile,
        name=f"{profile.name}-kv-fp8",
        model=roofline,
        num_kv_blocks=roofline.num_kv_blocks(profile.block_size),
    )


def _roofline_profile(name: str, gpu: Gpu, model: ModelShape, num_gpus: int) -> Profile:
    roofline = Roofline(gpu, model, num_gpus)
    return Profile(name, roofline, roofline.num_kv_blocks(16))


# Corral's own engine on one H100 80GB HBM3 with a Llama-3-8B-shaped checkpoint (bf16, CUDA
# graphs): `corral calibrate --device cuda` on 2026-11-25, engine d6fd68e, 408 steps, median fit
# error 2.2 % (docs/simulator.md). The KV size is what --gpu-memory-utilization 0.9 gave on that
# card with the scheduler sizes below.
H100_LLAMA3_8B_CORRAL = Fitted((8.406e-3, 1.138e-5, 2.504e-5, 1.932e-7, 0.0))

BUILTIN = {
    p.name: p
    for p in (
        _roofline_profile("h100-llama3-8b", H100, LLAMA3_8B, 1),
        _roofline_profile("h100-llama3-70b", H100, LLAMA3_70B, 4),
        _roofline_profile("a100-llama3-8b", A100, LLAMA3_8B, 1),
        _roofline_profile("a100-llama3-70b", A100, LLAMA3_70B, 4),
        # An embedding model, for --runner pooling: 512 positions; many short inputs a step.
        dataclasses.replace(_roofline_profile("h100-bge-large", H100, BGE_LARGE, 1), max_model_len=512),
        Profile(
            "h100-llama3-8b-corral",
            H100_LLAMA3_8B_CORRAL,
            num_kv_blocks=26855,
            kv_bytes_per_token=LLAMA3_8B.kv_bytes_per_token,  # bf16, one GPU
        ),
    )
}


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (`h100-llama3-8b`, ...) or a fitted one from a JSON file
    (raises ValueError naming the file and what is wrong with it)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown profile {name_or_path!r}: not one of {', '.join(BUILTIN)} nor a file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ValueError(f"{path}: not a JSON profile: {e}") from e
    return _fitted_profile(path, data)


# A profile file's sizes, checked against the engine flags' own bounds (so a hand-edited file
# cannot start a replica whose scheduler never runs anything, as max_num_seqs 0 would).
_SIZES = ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size")


def _fitted_profile(path: Path, data: object) -> Profile:
    if not isinstance(data, dict) or data.get("kind") != "fitted":
        raise ValueError(f"{path}: not a fitted profile (kind 'fitted' with 5 coefficients)")
    coefficients = data.get("coefficients")
    if not (
        isinstance(coefficients, list)
        and len(coefficients) == 5
        and all(_is_number(c) and c >= 0 for c in coefficients)
    ):
        raise ValueError(
            f"{path}: coefficients must be 5 numbers >= 0 (seconds a step, per sequence, per token, "
            f"per KV entry read, per query-key pair), got {coefficients!r}"
        )
    if not isinstance(data.get("name"), str) or "num_kv_blocks" not in data:
        raise ValueError(f"{path}: a fitted profile needs a name (a string) and num_kv_blocks")
    sizes = {k: data[k] for k in _SIZES if k in data}
    for key, value in sizes.items():
        problem = OPTIONS[key].problem(value) if _is_int(value) else "must be an integer"
        if problem is not None:
            raise ValueError(f"{path}: {key} {problem}, got {value!r}")
    kv_bytes = data.get("kv_bytes_per_token")  # absent from profiles written before calibrate recorded it
    if kv_bytes is not None and not (_is_int(kv_bytes) and kv_bytes >= 1):
        raise ValueError(f"{path}: kv_bytes_per_token must be an integer >= 1 or null, got {kv_bytes!r}")
    coefs = tuple(float(c) for c in coefficients)
    return Profile(data["name"], Fitted(coefs), **sizes, kv_bytes_per_token=kv_bytes)  # type: ignore[arg-type]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def describe(profile: Profile) -> dict[str, Any]:
    """The profile in a JSON-friendly form, for logs and benchmark reports."""
    model = profile.model
    kind = "fitted" if isinstance(model, Fitted) else "roofline"
    sizes = {f.name: getattr(profile, f.name) for f in fields(profile) if f.name != "model"}
    sizes["kv_bytes_per_token"] = profile.gpu_kv_bytes_per_token()  # a roofline's, worked out
    return {**sizes, "kind": kind, "model": asdict(model)}
