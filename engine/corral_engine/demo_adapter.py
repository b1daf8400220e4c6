"""Write a random PEFT LoRA adapter for a demo checkpoint (tests, docs; nothing downloaded).

PEFT starts B at zero, so a fresh adapter changes nothing; this one draws A and B both from a
seeded generator, so a request naming it generates differently from the base model. It targets the
modules PEFT finds in the base's transformers model: Phi-3's fused qkv_proj and gate_up_proj.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from corral_engine.lora import CONFIG_FILE, WEIGHTS_FILE, base_targets

__all__ = ["write_demo_adapter"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")  # the others are the MLP's


def _shapes(config: dict[str, Any], target: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder layer's projection."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "gate_up_proj": (hidden, 2 * inter),
        "down_proj": (inter, hidden),
    }[target]


def write_demo_adapter(
    model_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    targets: tuple[str, ...] | None = None,
) -> pathlib.Path:
    """A PEFT adapter (adapter_config.json, adapter_model.safetensors) for the dense checkpoint in
    `model_dir`, written to `out_dir`, targeting `targets` (None: every projection the base has);
    its path. Raises ValueError for a mixture-of-experts model."""
    import torch
    from safetensors.torch import save_file

    model_dir, out = pathlib.Path(model_dir), pathlib.Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if any(key in config for key in ("num_local_experts", "num_experts")):
        raise ValueError("demo adapters are for dense models (mixture-of-experts targets are not served)")
    targets = targets or base_targets((config.get("architectures") or [""])[0])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in targets:
            module = "self_attn" if target in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{target}"
            fan_in, fan_out = _shapes(config, target)
            # Deltas about as large as the base projections' outputs: greedy tokens change.
            a = torch.randn((rank, fan_in), generator=gen) / fan_in**0.5
            b = torch.randn((fan_out, rank), generator=gen) * (0.5 / rank)
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
