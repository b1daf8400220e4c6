"""Which files of a checkpoint hold its weights, as vLLM's `--load-format auto` picks them:
safetensors where the checkpoint has any, else PyTorch's pickled `pytorch_model*.bin` (older hub
repos ship only those). Pure: the model cache and the loader both read it."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Literal

WeightFormat = Literal["safetensors", "pt"]
SAFETENSORS = "*.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PT = "pytorch_model*.bin"
PT_INDEX = "pytorch_model.bin.index.json"
_PATTERNS: dict[WeightFormat, str] = {"safetensors": SAFETENSORS, "pt": PT}
INDEXES: dict[WeightFormat, str] = {"safetensors": SAFETENSORS_INDEX, "pt": PT_INDEX}


def weight_format(names: Iterable[str]) -> WeightFormat | None:
    """The format of the weights among file `names` (paths in a repository: only its top level
    counts, as the engine reads one flat directory): safetensors first, PyTorch pickles only
    without them; None: neither."""
    names = [name for name in names if "/" not in name]
    for kind in ("safetensors", "pt"):
        if any(fnmatch.fnmatch(name, _PATTERNS[kind]) for name in names):
            return kind
    return None


def weight_pattern(names: Iterable[str]) -> str:
    """The pattern of the weight files to fetch from a listing of `names` (safetensors when it
    has both: the pickles are never downloaded then)."""
    return _PATTERNS[weight_format(names) or "safetensors"]


def is_weight_file(name: str, kind: WeightFormat) -> bool:
    return fnmatch.fnmatch(name, _PATTERNS[kind])
