"""The Qwen2-VL / Qwen2.5-VL vision transformer and patch merger, under the checkpoint's names
(`visual.*`). Patches arrive flattened by the image processor ([S, C * T * P * P], in 2x2 merge
blocks); the tower attends bidirectionally within each image (Qwen2.5-VL: within windows, except
its full-attention layers) with a 2-D rotary over (h, w), and the merger turns each 2x2 block into
one text-model row. Every matmul runs on 2-D rows (the runner's Linear layers may be prepacked)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from corral_engine.model.llama import FusedLinear, Linear, RMSNorm
from corral_engine.model.rotary import rotate_half
from corral_engine.model.vision import activation
from corral_engine.qwen_vision_config import QwenVisionConfig

_EPS = 1e-6  # both towers' norms
Spans = list[tuple[int, int]]  # row ranges that attend to each other


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d over (T, P, P), run as transformers runs it (same values)."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, C*T*P*P] -> [S, D]
        out = self.proj(x.view(-1, *self.shape).to(self.proj.weight.dtype))  # [S, D, 1, 1, 1]
        return out.view(x.shape[0], -1)


class VisionAttention(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        dim = config.embed_dim
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Spans) -> torch.Tensor:
        rows, dim = x.shape
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim).unbind(1)  # each [S, H, hd]
        # The rotary in float32, as transformers applies it, then back to the model dtype.
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        # Spans of one length attend in one batched call (windows are mostly full-sized).
        by_length: dict[int, list[int]] = {}
        for start, end in spans:
            by_length.setdefault(end - start, []).append(start)
        for length, starts in by_length.items():
            index = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).to(x.device)  # [n, L]
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # each [n, H, L, hd]
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5)  # not causal
            out[index.flatten()] = o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return self.proj(out.view(rows, dim))


class VisionMLP(nn.Module):
    """Qwen2-VL's: fc1, QuickGELU, fc2."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.act = config.hidden_act
        self.fc1 = Linear(config.embed_dim, config.intermediate_size, bias=True)
        self.fc2 = Linear(config.intermediate_size, config.embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's: down(silu(gate(x)) * up(x)), gate and up fused at load time."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.size = size
        self.gate_up_proj = FusedLinear(config.embed_dim, {"gate_proj": size, "up_proj": size}, bias=True)
        self.down_proj = Linear(size, config.embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [S, 2I]
        return self.down_proj(F.silu(gate_up[:, : self.size]) * gate_up[:, self.size :])


def _norm(config: QwenVisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, _EPS) if config.is_qwen2_5 else nn.LayerNorm(dim, eps=_EPS)


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.embed_dim)
        self.norm2 = _norm(config, config.embed_dim)
        self.attn = VisionAttention(config)
        self.mlp: nn.Module = GatedVisionMLP(config) if config.is_qwen2_5 else VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Spans) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block's rows normed, concatenated and projected to the text model's width."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.width = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = _norm(config, config.embed_dim)
        self.mlp = nn.Sequential(
            Linear(self.width, self.width, bias=True),
            nn.GELU(),
            Linear(self.width, config.out_hidden_size, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, D] -> [S / 4, hidden]
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[S, C*T*P*P] patches of the images on `grids` -> [S / 4, hidden] rows, image by image."""
        config = self.config
        unit = config.spatial_merge_size**2
        x = self.patch_embed(pixels)  # [S, D]
        cos, sin = self._rotary(grids, x.device)  # each [S, 1, hd] float32
        frames: Spans = []  # full attention: each frame of each image
        for t, h, w in grids:
            for _ in range(t):
                start = frames[-1][1] if frames else 0
                frames.append((start, start + h * w))
        order = None
        windows = frames
        if config.is_qwen2_5:
            units, windows = window_order(grids, config)
            order = torch.from_numpy(units).to(x.device)
            x, cos, sin = (_by_unit(t, order, unit) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            is_full = not config.is_qwen2_5 or i in config.fullatt_block_indexes
            x = block(x, cos, sin, frames if is_full else windows)
        merged = self.merger(x)  # [S / 4, hidden]
        if order is None:
            return merged
        return merged[torch.argsort(order)]  # back to each image's row-major merge blocks

    def _rotary(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2-D rotary's cos/sin [S, 1, hd]: the first half of each head's frequencies turn
        with the patch's row, the second with its column (patches in merge-block order)."""
        hd = self.config.embed_dim // self.config.num_heads
        spatial = hd // 2
        inv_freq = 1.0 / (
            self.config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)
        )
        positions = torch.from_numpy(patch_positions(grids, self.config.spatial_merge_size))  # [S, 2]
        freqs = (positions[..., None].float() * inv_freq).flatten(1)  # [S, hd/2]: h's then w's
        emb = torch.cat((freqs, freqs), dim=-1).to(device)  # [S, hd]
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def _by_unit(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows regrouped by merge block (`unit` rows each) in `order`."""
    return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """[S, 2] (row, column) of every patch, in the processor's order: 2x2 merge blocks row-major,
    row-major inside each block, every frame alike."""
    out = []
    for t, h, w in grids:
        grid_rows, grid_cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = grid_rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        cols = grid_cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out)


def window_order(grids: list[tuple[int, int, int]], config: QwenVisionConfig) -> tuple[np.ndarray, Spans]:
    """Qwen2.5-VL's windows: (the merge blocks' order with each window's blocks together, the row
    spans of the windows in that order). A window is a square of merge blocks, window_size pixels
    a side; windows at the right and bottom edges hold what is left."""
    side = config.window_size // config.spatial_merge_size // config.patch_size  # blocks a side
    unit = config.spatial_merge_size**2
    order: list[np.ndarray] = []
    spans: Spans = []
    first = 0  # the image's first merge block
    for t, h, w in grids:
        bh, bw = h // config.spatial_merge_size, w // config.spatial_merge_size
        blocks = np.arange(t * bh * bw).reshape(t, bh, bw) + first
        for frame in blocks:
            for top in range(0, bh, side):
                for left in range(0, bw, side):
                    window = frame[top : top + side, left : left + side].reshape(-1)
                    start = spans[-1][1] if spans else 0
                    spans.append((start, start + len(window) * unit))
                    order.append(window)
        first += t * bh * bw
    return np.concatenate(order), spans
