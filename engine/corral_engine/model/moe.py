"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE) that stands in for a layer's MLP.

A router picks each token's top-k experts; every expert multiplies only the rows routed to it
(index_select in, index_add_ out), in ascending expert order as transformers does, so float32
outputs match it and bf16 ones round alike. Parameter names are transformers v5's in-memory
ones (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); the loader fills
them from per-expert checkpoint tensors too. Under tensor parallelism each rank holds every expert's
slice of the intermediate size (as the dense MLP's) and the router whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from corral_engine.model.config import ModelConfig, MoeConfig
from corral_engine.model.parallel import TensorParallel


class Router(nn.Module):
    """Softmax over the experts in float32, the top k, renormalised where the model says so."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.weight)  # [T, E] in the model dtype, as transformers computes it
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.num_experts_per_tok, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.moe.is_weight_fp32:
            weights = weights.to(x.dtype)
        return weights, experts


class Experts(nn.Module):
    """Every expert's gate and up projections fused ([E, 2I, hidden], gate rows first) and its down
    projection ([E, hidden, I]); I is this rank's share of the intermediate size."""

    def __init__(self, hidden_size: int, num: int, size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num, hidden_size, size))
        self.size = size

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights and experts [T, k] -> the weighted sum of each row's experts."""
        out = torch.zeros_like(x)
        top_k = experts.shape[-1]
        flat = experts.flatten()  # [T k]: row t's picks at t k .. t k + k - 1
        order = torch.argsort(flat, stable=True)  # picks grouped by expert
        # One host read per layer: how many rows each expert takes (the shapes below depend on it).
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        rows, scales = order // top_k, weights.flatten().index_select(0, order)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            picked = rows[start : start + count]  # [n] distinct rows (top-k picks are distinct)
            h = x.index_select(0, picked)  # [n, hidden]
            gate_up = F.linear(h, self.gate_up_proj[expert])  # [n, 2I]
            act = F.silu(gate_up[:, : self.size]) * gate_up[:, self.size :]
            y = F.linear(act, self.down_proj[expert])  # [n, hidden]
            # Scaled in the weights' dtype (float32 for Mixtral), rounded to the model's, then added.
            out.index_add_(0, picked, (y * scales[start : start + count, None]).to(x.dtype))
            start += count
        return out


class SparseMoeBlock(nn.Module):
    """A layer's MLP replaced by routed experts; under tensor parallelism every rank routes alike
    (the router and its input are the same on each) and one all-reduce sums the experts' partial
    outputs, as after the dense MLP."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if config.moe is None:
            raise ValueError("SparseMoeBlock needs a mixture-of-experts config")
        self.tp = tp
        self.gate = Router(config.hidden_size, config.moe)
        size = config.moe.intermediate_size if tp is None else tp.plan.expert_intermediate_size
        self.experts = Experts(config.hidden_size, config.moe.num_experts, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        return out if self.tp is None else self.tp.all_reduce(out)
