"""The CLIP vision transformer (LLaVA's vision tower): patch embeddings with a class token and
learned positions, pre-LN encoder layers with bidirectional attention; returns the hidden states
of the configured feature layers. Every matmul runs on [N * P, D] rows (the runner's Linear
layers may hold their weight prepacked, which only 2-D inputs read)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from corral_engine.model.llama import FusedLinear, Linear
from corral_engine.vision_config import LlavaVisionConfig


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """CLIP's quick_gelu or the exact (erf) gelu, as transformers' ACT2FN computes them."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x)


class VisionEmbeddings(nn.Module):
    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, dim, kernel_size=config.patch_size, stride=config.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(
            config.num_patches + 1, dim, _weight=torch.empty(config.num_patches + 1, dim)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, P + 1, D]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [N, D, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.qkv_proj = FusedLinear(dim, {"q_proj": dim, "k_proj": dim, "v_proj": dim}, bias=True)
        self.out_proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:  # [N * T, D]
        rows, dim = x.shape
        qkv = self.qkv_proj(x).view(num_images, rows // num_images, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, H, T, hd]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # not causal
        return self.out_proj(out.transpose(1, 2).reshape(rows, dim))


class VisionMLP(nn.Module):
    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        self.act = config.hidden_act
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), num_images)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))


class VisionTower(nn.Module):
    """CLIPVisionModel's parameters under its names (post_layernorm is loaded, never used: LLaVA
    reads inner hidden states)."""

    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        self.config = config
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=eps)  # transformers' spelling, kept for the names
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, T, D * len(feature_layers)] features (T: P, or P + 1 with "full")."""
        wanted = self.config.layer_indices
        num_images = pixel_values.shape[0]
        x = self.pre_layrnorm(self.embeddings(pixel_values))  # [N, P + 1, D]
        num_positions, dim = x.shape[1], x.shape[2]
        x = x.reshape(-1, dim)  # [N * (P + 1), D]
        states = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):  # later ones unused
            x = layer(x, num_images)
            if i in wanted:
                states[i] = x
        picked = [states[i].view(num_images, num_positions, dim) for i in wanted]
        if self.config.select_strategy == "default":
            picked = [p[:, 1:] for p in picked]
        return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
