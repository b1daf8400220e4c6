"""What serving LoRA adapters adds to a simulated step: copying an adapter into a device slot when a
step first runs it, and the shrink/expand products of each active adapter (a roofline)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from corral_engine.sim.perf_model import H100, LLAMA3_8B, LLAMA3_70B, Gpu, ModelShape, Profile, Roofline

# The MLP width of the built-in models (the step-time model does not need it otherwise).
INTERMEDIATE_SIZE = {LLAMA3_8B: 14336, LLAMA3_70B: 28672}
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_params(model: ModelShape, intermediate_size: int, rank: int, targets: tuple[str, ...]) -> int:
    """Parameters of a rank-`rank` adapter on `targets` of every layer: r x (in + out) per projection."""
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, intermediate_size),
        "up_proj": (h, intermediate_size),
        "down_proj": (intermediate_size, h),
    }
    return model.num_layers * sum(rank * sum(shapes[t]) for t in targets)


@dataclass(frozen=True, slots=True)
class LoraCost:
    """Seconds LoRA adds to a step, on each GPU of a tensor-parallel group (each holds its shard).
    A step with no adapter request costs nothing extra (Corral's engine then skips the LoRA layers)."""

    adapter_bytes: float  # one adapter's A and B weights, all GPUs together
    num_gpus: int = 1
    bytes_per_param: int = 2  # bf16
    # Host to device: PCIe Gen5 x16 is 64 GB/s a direction; the copies into a slot are many small
    # per-layer tensors from pageable host memory, so about 40% of it.
    h2d_bandwidth_bytes_s: float = 25e9
    memory_bandwidth_bytes_s: float = 0.85 * H100.memory_bandwidth_bytes_s  # as the roofline's decode
    flops_s: float = 0.6 * H100.peak_flops  # as the roofline's prefill
    # Shrink and expand launches per target group and layer, once a step has any adapter: vLLM V1
    # measured LoRA at ~3% below the base model's ShareGPT throughput (A100, 4 slots; PR 11613).
    step_overhead_s: float = 0.2e-3

    @property
    def load_s(self) -> float:
        """Copying one adapter into a free (or least recently used) slot."""
        return self.adapter_bytes / self.num_gpus / self.h2d_bandwidth_bytes_s

    def step_time_s(self, num_loads: int, num_active: int, num_lora_tokens: int) -> float:
        """Extra seconds of a step that loads `num_loads` adapters, runs `num_active` distinct ones
        and computes `num_lora_tokens` tokens through them: each active adapter's weights read once,
        2 FLOPs a parameter a token, and the loads before the forward pass can start."""
        if not num_active:
            return 0.0
        per_gpu_bytes = self.adapter_bytes / self.num_gpus
        read_s = num_active * per_gpu_bytes / self.memory_bandwidth_bytes_s
        flops = 2 * num_lora_tokens * self.adapter_bytes / self.bytes_per_param  # shrink + expand
        compute_s = flops / (self.num_gpus * self.flops_s)
        return num_loads * self.load_s + self.step_overhead_s + max(read_s, compute_s)


def lora_cost(
    profile: Profile,
    rank: int = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    model: ModelShape = LLAMA3_8B,
    gpu: Gpu = H100,
) -> LoraCost:
    """The cost of rank-`rank` adapters on `profile`'s model and GPUs; a fitted profile (which has
    no shapes) is taken as one `gpu` serving `model`."""
    roofline = profile.model if isinstance(profile.model, Roofline) else Roofline(gpu, model)
    model = roofline.model
    # Adapters stay in the model dtype over quantized weights; the MLP width is the unquantized shape's.
    intermediate = INTERMEDIATE_SIZE.get(dataclasses.replace(model, quantization=None), 4 * model.hidden_size)
    num_bytes = adapter_params(model, intermediate, rank, targets) * model.bytes_per_param
    return LoraCost(
        adapter_bytes=num_bytes,
        num_gpus=roofline.num_gpus,
        bytes_per_param=model.bytes_per_param,
        memory_bandwidth_bytes_s=roofline.bandwidth_efficiency * roofline.gpu.memory_bandwidth_bytes_s,
        flops_s=roofline.compute_efficiency * roofline.gpu.peak_flops,
    )
