"""An adapter's weights: read from its PEFT files (safetensors, or the older pickled .bin), checked
against the base model's projections, and cut to this rank's shard under tensor parallelism."""

from __future__ import annotations

import contextlib
import pathlib
import pickle
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from corral_engine.lora import WEIGHTS_FILE, AdapterConfig, AdapterError, LoraRequest, read_adapter_config
from corral_engine.model.config import ModelConfig
from corral_engine.model.loader import read_cut
from corral_engine.model.parallel import Cut, ShardPlan
from corral_engine.weight_files import adapter_weights

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT may keep the adapter's
# name, "default", before .weight in files saved from a live model).
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_EXPERTS = re.compile(r"\.experts\.|\.block_sparse_moe\.")
# adapter target -> (its module in the layer, the (fused) Linear holding it)
HOLDERS = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "qkv_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "gate_up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


Tensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class AdapterWeights:
    """A registered adapter: its config and its weights in host memory, (layer, projection) ->
    (A [r, in], B [out, r]), or None while they are dropped from the host cache."""

    lora: LoraRequest
    config: AdapterConfig
    tensors: Tensors | None


class AdapterReader:
    """Reads adapters for one base model (this rank's shard of it), refusing what it cannot serve."""

    def __init__(
        self,
        config: ModelConfig,
        plan: ShardPlan | None,  # this rank's shard, or None: whole
        targets: tuple[str, ...],  # the modules adapters may name
        projections: Container[tuple[int, str]],  # the base's (layer, projection) pairs
        max_rank: int,
        dtype: torch.dtype,  # the weights' as read (the slots')
    ) -> None:
        self.config, self.plan, self.targets = config, plan, targets
        self.projections, self.max_rank, self.dtype = projections, max_rank, dtype

    def read(self, lora: LoraRequest) -> AdapterWeights:
        config = read_adapter_config(lora.name, lora.path, self.max_rank)
        others = [t for t in config.target_modules if t not in self.targets]
        if others:
            raise AdapterError(
                f"adapter {lora.name!r}: target modules {', '.join(others)} are not modules of this "
                f"{self.config.architecture} base model, whose adapters target "
                f"{', '.join(self.targets)} (was it trained on another architecture?)"
            )
        directory = pathlib.Path(lora.path)
        found = adapter_weights(p.name for p in directory.iterdir()) if directory.is_dir() else None
        path = directory / (found or WEIGHTS_FILE)
        if found is None:
            raise AdapterError(f"adapter {lora.name!r}: {path} is missing")
        try:
            with _opened(path) as parts:
                # Slices: a rank reads only its shard's bytes (see _checked).
                pairs: dict[tuple[int, str], dict[str, Any]] = {}
                for key, part in parts:
                    layer, projection, which = self._key(lora.name, key, config)
                    pairs.setdefault((layer, projection), {})[which] = part
                tensors = {where: self._checked(lora.name, where, ab, config) for where, ab in pairs.items()}
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
            if isinstance(e, AdapterError):
                raise
            raise AdapterError(f"adapter {lora.name!r}: cannot read {path}: {e}") from None
        if not tensors:
            raise AdapterError(f"adapter {lora.name!r}: {path} holds no LoRA weights")
        return AdapterWeights(lora, config, tensors)

    def _key(self, name: str, key: str, config: AdapterConfig) -> tuple[int, str, str]:
        if _EXPERTS.search(key):
            raise AdapterError(f"adapter {name!r}: mixture-of-experts targets are not supported ({key})")
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: unexpected tensor {key}")
        layer, module, part, which = int(match[1]), match[2], match[3], match[4]
        if part not in config.target_modules or HOLDERS.get(part, ("",))[0] != module:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not one of its target modules")
        if (layer, part) not in self.projections:
            raise AdapterError(f"adapter {name!r}: tensor {key} names a layer the base model lacks")
        return layer, part, which

    def _checked(
        self, name: str, where: tuple[int, str], ab: dict[str, Any], config: AdapterConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of one projection, checked against the whole model's shapes (the same check and
        message on every rank), then read: this rank's shard of them under tensor parallelism."""
        layer, part = where
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {part} lacks its lora_{'AB'[len(ab) % 2]}")
        out_features, in_features = _full_shape(self.config, part)
        want_a, want_b = (config.rank, in_features), (out_features, config.rank)
        shape_a, shape_b = tuple(ab["A"].get_shape()), tuple(ab["B"].get_shape())
        if shape_a != want_a or shape_b != want_b:
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {part} has lora_A {shape_a} and lora_B "
                f"{shape_b}; the base model needs {want_a} and {want_b}"
            )
        cut_a, cut_b = self._cuts(layer, part)
        a = ab["A"][:] if cut_a is None else read_cut(ab["A"], cut_a)  # [r, in] or this rank's columns
        b = ab["B"][:] if cut_b is None else read_cut(ab["B"], cut_b)  # [out, r] or this rank's rows
        return a.to(self.dtype), b.to(self.dtype)

    def _cuts(self, layer: int, part: str) -> tuple[Cut | None, Cut | list[Cut] | None]:
        """How this rank reads (lora_A, lora_B): the base weight's own cut, on the dimension each
        shares with it. Column-parallel (dim 0, the rank's output rows) cuts B's rows [out, r];
        row-parallel (dim 1, its input columns) cuts A's columns [r, in]. None: read it whole."""
        if self.plan is None:
            return None, None
        cut = self.plan.checkpoint_slice(f"model.layers.{layer}.{HOLDERS[part][0]}.{part}.weight")
        if isinstance(cut, list):  # a fused projection (Phi-3's): B's rows of each part, concatenated
            return None, cut
        if not isinstance(cut, tuple):  # every dense projection is cut; nothing else is a target
            raise AdapterError(f"{part} has no tensor-parallel shard")
        return (cut, None) if cut[0] == 1 else (None, cut)


def _full_shape(config: ModelConfig, part: str) -> tuple[int, int]:
    """(out_features, in_features) of projection `part` in the whole (unsharded) model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }[part]


class _Whole:
    """A tensor of an unpickled adapter, read as a safetensors slice is (get_shape, indexing)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


@contextlib.contextmanager
def _opened(path: pathlib.Path) -> Iterator[Iterator[tuple[str, Any]]]:
    """An adapter file's (name, slice) pairs: safetensors' lazy slices, or for PEFT's older
    `adapter_model.bin` its tensors unpickled with weights_only (never code)."""
    if path.suffix == ".bin":
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"it holds a {type(state).__name__}, not a state dict of tensors")
        yield ((str(k), _Whole(v)) for k, v in state.items())
        return
    with safe_open(str(path), framework="pt") as f:
        yield ((key, f.get_slice(key)) for key in f.keys())  # noqa: SIM118 (safe_open is not a mapping)
