"""Which files of a checkpoint hold its weights, as vLLM's `--load-format auto` picks them:
safetensors where the checkpoint has any, else PyTorch's pickled `pytorch_model*.bin` (older hub
repos ship only those; PEFT adapters saved before safetensors became its default hold
`adapter_model.bin`). Pure: the model cache and the loaders read it."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Literal

WeightFormat = Literal["safetensors", "pt"]
SAFETENSORS = "*.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PT = "pytorch_model*.bin"
PT_INDEX = "pytorch_model.bin.index.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_PT = "adapter_model.bin"
_PATTERNS: dict[WeightFormat, tuple[str, ...]] = {"safetensors": (SAFETENSORS,), "pt": (PT, ADAPTER_PT)}
INDEXES: dict[WeightFormat, str] = {"safetensors": SAFETENSORS_INDEX, "pt": PT_INDEX}


def weight_format(names: Iterable[str]) -> WeightFormat | None:
    """The format of the weights among file `names` (paths in a repository: only its top level
    counts, as the engine reads one flat directory): safetensors first, PyTorch pickles only
    without them; None: neither."""
    names = [name for name in names if "/" not in name]
    for kind in ("safetensors", "pt"):
        if any(is_weight_file(name, kind) for name in names):
            return kind
    return None


def weight_patterns(names: Iterable[str]) -> tuple[str, ...]:
    """The patterns of the weight files to fetch from a listing of `names` (safetensors when it
    has both: the pickles are never downloaded then)."""
    return _PATTERNS[weight_format(names) or "safetensors"]


def is_weight_file(name: str, kind: WeightFormat) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in _PATTERNS[kind])


def adapter_weights(names: Iterable[str]) -> str | None:
    """Which file holds a PEFT adapter's weights among `names`: safetensors first; None: neither."""
    present = set(names)
    return next((f for f in (ADAPTER_SAFETENSORS, ADAPTER_PT) if f in present), None)
