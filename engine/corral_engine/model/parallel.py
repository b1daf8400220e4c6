"""Tensor parallelism (Megatron-style): how a model is cut across ranks, and the two collectives
its forward pass needs.

Rank r of N holds: query heads [r H/N, (r+1) H/N); KV heads [r KVH/N, ...) when KVH >= N, else
KV head r KVH / N, replicated on the N / KVH ranks whose query heads use it; rows of the
intermediate size (gate/up are column-parallel, down row-parallel); rows of the vocabulary
(embedding and LM head; the last rank's slice is padded); and every expert's rows of the experts'
intermediate size, the router whole. o_proj, down_proj and the expert block each end in one
all-reduce; their bias is held by rank 0 alone so the sum adds it once. With one rank none of
this exists: the model is built without a `TensorParallel` and runs no collective.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from corral_engine.errors import ModelLoadError
from corral_engine.model.config import ModelConfig

# A collective waits this long for a slow peer; a dead one is seen at once (the socket closes).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# How long the ranks may take to meet at start-up (a worker imports torch first); a rank that dies
# before it would otherwise leave the others waiting this long.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=2)

_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
# Projections a checkpoint may hold already fused (Phi-3): the parts stacked in its rows, in order.
_FUSED = {"qkv_proj": ("q", "kv", "kv"), "gate_up_proj": ("mlp", "mlp")}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
# One expert's projections as checkpoints name them (Mixtral's w1/w3/w2, Qwen3-MoE's) -> which part
# of the expert each is: gate and up are column-parallel, down row-parallel, all over the experts'
# intermediate size. The loader maps per-expert tensors into the fused parameters by it too.
EXPERT_PARTS = {
    "w1": "gate",
    "gate_proj": "gate",
    "w3": "up",
    "up_proj": "up",
    "w2": "down",
    "down_proj": "down",
}

# How a rank reads one checkpoint tensor: (dim, start, length), or a list of such pieces concatenated
# along their dim (a fused gate/up tensor's gate rows and up rows).
Cut = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Rank `rank` of `size`: the local sizes and where its slices start in the checkpoint."""

    rank: int
    size: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    total_kv_heads: int  # the model's (a fused QKV tensor's K rows span them all)
    kv_head_start: int
    head_dim: int
    intermediate_size: int  # local
    expert_intermediate_size: int  # local, each expert's; 0 without experts
    vocab_size: int  # local, padded: every rank holds the same number of rows
    full_vocab_size: int

    @classmethod
    def build(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        check_shardable(config, size)
        heads, kv_heads = config.num_heads, config.num_kv_heads
        return cls(
            rank=rank,
            size=size,
            num_heads=heads // size,
            num_kv_heads=max(1, kv_heads // size),
            total_kv_heads=kv_heads,
            kv_head_start=rank * kv_heads // size,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size // size,
            expert_intermediate_size=0 if config.moe is None else config.moe.intermediate_size // size,
            vocab_size=-(-config.vocab_size // size),
            full_vocab_size=config.vocab_size,
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size

    def _range(self, kind: str) -> tuple[int, int]:
        d = self.head_dim
        if kind == "q":
            return self.rank * self.num_heads * d, self.num_heads * d
        if kind == "kv":
            return self.kv_head_start * d, self.num_kv_heads * d
        if kind == "mlp":
            return self.rank * self.intermediate_size, self.intermediate_size
        start = self.vocab_start  # "vocab": clipped to the real rows (the padding stays zero)
        return start, max(0, min(self.vocab_size, self.full_vocab_size - start))

    def checkpoint_slice(self, name: str) -> Cut | list[Cut] | bool | None:
        """How this rank reads checkpoint tensor `name`: (dim, start, length), or such pieces
        concatenated; None to read it whole (replicated); False to skip it (a row-parallel bias on
        ranks other than 0)."""
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        if "experts" in parts:
            return self._expert_slice(module, kind)
        if module in _COLUMN:
            return (0, *self._range(_COLUMN[module]))
        if module in _FUSED:
            return self._fused_slice(module)
        if module in _ROW:
            if kind == "bias":
                return None if self.rank == 0 else False
            return (1, *self._range(_ROW[module]))
        if module in ("embed_tokens", "lm_head"):
            return (0, *self._range("vocab"))
        return None

    def _fused_slice(self, module: str) -> list[Cut]:
        """A fused checkpoint tensor's cut (weight or bias, column-parallel): this rank's rows of
        each part, read from where that part starts (q|k|v: H D, KVH D, KVH D rows; gate|up)."""
        full = {
            "q": self.num_heads * self.size * self.head_dim,
            "kv": self.total_kv_heads * self.head_dim,
            "mlp": self.intermediate_size * self.size,
        }
        cuts: list[Cut] = []
        offset = 0
        for part in _FUSED[module]:
            start, length = self._range(part)
            cuts.append((0, offset + start, length))
            offset += full[part]
        return cuts

    def _expert_slice(self, module: str, kind: str) -> Cut | list[Cut] | None:
        """An expert tensor's cut: per expert ([I, H] gate/up, [H, I] down) or fused over the
        experts ([E, 2I, H] gate rows then up rows, [E, H, I] down)."""
        size = self.expert_intermediate_size
        start = self.rank * size
        if kind != "weight" and module != "experts":
            return None  # no expert of these architectures has a bias: the loader names it
        part = EXPERT_PARTS.get(module)
        if part in ("gate", "up"):
            return (0, start, size)
        if part == "down":
            return (1, start, size)
        if module == "experts" and kind == "gate_up_proj":
            return [(1, start, size), (1, self.size * size + start, size)]
        if module == "experts" and kind == "down_proj":
            return (2, start, size)
        return None  # not an expert projection: the loader names it if unexpected


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise ModelLoadError unless `size` ranks can split this model's heads, MLP and experts evenly."""
    if size > 1 and config.family is not None and config.family.is_post_norm:
        raise ModelLoadError(
            "--tensor-parallel-size is not supported for OLMo 2 yet: its q/k norms span every head"
        )
    problems = []
    if config.num_heads % size:
        problems.append(f"the {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"the {kv} KV heads (or be a multiple of them)")
    has_dense_mlp = not all(config.is_sparse_layer(i) for i in range(config.num_layers))
    if has_dense_mlp and config.intermediate_size % size:
        problems.append(f"the MLP's intermediate size {config.intermediate_size}")
    if config.moe is not None and config.moe.intermediate_size % size:
        problems.append(f"the experts' intermediate size {config.moe.intermediate_size}")
    if problems:
        raise ModelLoadError(f"--tensor-parallel-size {size} must divide {', '.join(problems)}")


class TensorParallel:
    """This rank's place in the group and the collectives the model runs over it."""

    def __init__(self, plan: ShardPlan, group: Any, device: torch.device) -> None:
        self.plan = plan
        self.rank, self.size = plan.rank, plan.size
        self.group = group  # a ProcessGroupGloo or ProcessGroupNCCL, used directly (no global state)
        self.device = device  # where the group's tensors live (NCCL: this rank's GPU)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        if hasattr(self.group, "shutdown"):  # ends the NCCL communicators; gloo closes with the object
            self.group.shutdown()

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[S, V/N] on every rank -> [S, V] on rank 0 (an empty tensor elsewhere)."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            self.group.gather([parts], [local], opts).wait()
            return torch.cat(parts, dim=-1)[:, : self.plan.full_vocab_size]
        self.group.gather([], [local], opts).wait()
        return local.new_empty((0, self.plan.full_vocab_size))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids outside them look up zeros, and the all-reduce
    sums every rank's rows into the full lookup."""

    def __init__(self, tp: TensorParallel, hidden_size: int) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.zeros(tp.plan.vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.tp.plan.vocab_start
        outside = (local < 0) | (local >= self.tp.plan.vocab_size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


def make_group(store_path: Path, rank: int, size: int, device: torch.device) -> Any:
    """The process group of `size` ranks meeting through a file store: gloo on the CPU (over
    127.0.0.1), NCCL on CUDA."""
    store = dist.FileStore(str(store_path), size)
    store.set_timeout(RENDEZVOUS_TIMEOUT)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, opts)
