"""Turn a written demo checkpoint into a Hugging Face fine-grained FP8 one, as transformers'
FineGrainedFP8Config and models published "-FP8" hold them: each dense attention and MLP
projection `X.weight` becomes float8_e4m3fn [out, in] plus `X.weight_scale_inv` float32
[ceil(out/128), ceil(in/128)] (its value = fp8 * the scale of its block; edge blocks are ragged)."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

BLOCK_SIZE = (128, 128)
FP8_MAX = 448.0
# Phi-3's fused qkv_proj and gate_up_proj too, as its FP8 checkpoints hold them.
_PROJECTION = re.compile(r"\.(?:self_attn\.(?:[qkvo]|qkv)_proj|mlp\.(?:gate|up|down|gate_up)_proj)\.weight$")


def fp8_quantization_config(block_size: tuple[int, int] = BLOCK_SIZE) -> dict[str, Any]:
    """config.json's quantization_config for such a checkpoint (the LM head stays unquantized)."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block_size),
        "modules_to_not_convert": ["lm_head"],
    }


def quantize_blocks(w: Any, block_size: tuple[int, int] = BLOCK_SIZE) -> tuple[Any, Any]:
    """w [R, C] -> (fp8 [R, C], weight_scale_inv [ceil(R/b0), ceil(C/b1)] float32): each block scaled
    so its largest magnitude is fp8's largest (transformers' rule), an all-zero block by 1."""
    import torch
    import torch.nn.functional as F

    rows, cols = w.shape
    b0, b1 = block_size
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = F.pad(w.float(), (0, nc * b1 - cols, 0, nr * b0 - rows))  # zeros change no block's max
    blocks = padded.reshape(nr, b0, nc, b1)
    amax = blocks.abs().amax(dim=(1, 3))  # [nr, nc]
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    q = (blocks * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(nr * b0, nc * b1)[:rows, :cols].contiguous(), (1.0 / scale).float()


def quantize_checkpoint(out: pathlib.Path, block_size: tuple[int, int] = BLOCK_SIZE) -> None:
    """Rewrite the safetensors files in `out` shard by shard (and the index, when sharded)."""

    def fp8(name: str, tensor: Any) -> dict[str, Any]:
        q, scale_inv = quantize_blocks(tensor, block_size)
        return {name: q, name.removesuffix("weight") + "weight_scale_inv": scale_inv}

    rewrite_projections(out, lambda name: ".experts." not in name, fp8)


def rewrite_projections(
    out: pathlib.Path, takes: Callable[[str], bool], replace: Callable[[str, Any], dict[str, Any]]
) -> None:
    """Rewrite the safetensors files in `out` shard by shard (and the index, when sharded): each
    dense attention or MLP projection's `X.weight` that `takes` accepts becomes what `replace`
    returns for it (the quantized format's tensors); every other tensor stays."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for file in sorted(out.glob("*.safetensors")):
        state = {}
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensor = f.get_tensor(name)
                if _PROJECTION.search(name) and takes(name):
                    state.update(replace(name, tensor))
                else:
                    state[name] = tensor
        save_file(state, str(file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, file.name))
        total += sum(t.nbytes for t in state.values())
    index = out / "model.safetensors.index.json"
    if index.is_file():
        text = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index.write_text(json.dumps(text, indent=2, sort_keys=True) + "\n", encoding="utf-8")
