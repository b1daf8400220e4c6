"""LoRA adapters as the engine's callers see them (light; no torch): a request's adapter, an
adapter's PEFT config read and checked, `--lora-modules` items parsed, and the registry of served
adapters that the server and the simulator share.

The weights themselves are read and applied by model/lora.py, in the process that runs the model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import pathlib
from dataclasses import dataclass

from corral_engine.errors import EngineError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: the dense decoder's linear layers (vLLM's names), as
# the base model's transformers modules name them: split, or Phi-3's fused qkv_proj / gate_up_proj.
SPLIT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SUPPORTED_TARGETS = tuple(dict.fromkeys(SPLIT_TARGETS + FUSED_TARGETS))
# Architectures whose checkpoints (so PEFT adapters trained on them) hold the fused projections.
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


class AdapterError(EngineError, ValueError):
    """An adapter cannot be served: missing files, an unsupported target, too large a rank, a
    shape the base model does not have. The message names the adapter and the problem."""


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """The adapter a request runs with: its served name, an id unique for this engine's life (a
    name loaded again gets a new id, so its prefix-cache blocks are its own) and its directory."""

    name: str
    lora_id: int
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """The parts of a PEFT adapter_config.json the engine uses."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(name: str, path: str, max_rank: int) -> AdapterConfig:
    """The adapter's config, checked: raises AdapterError naming `name` and what is wrong."""
    directory = pathlib.Path(path)
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a directory")
    if not config_path.is_file():
        raise AdapterError(f"adapter {name!r}: {config_path} is missing")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {config_path}: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name!r}: {config_path} is not a JSON object")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if type(rank) is not int or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: its rank {rank} is larger than --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias {raw['bias']!r} is not supported (only 'none')")
    if raw.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save is not supported")
    targets = _targets(name, raw.get("target_modules"))
    return AdapterConfig(rank, float(alpha), targets, bool(raw.get("use_rslora")))


def _targets(name: str, given: object) -> tuple[str, ...]:
    if isinstance(given, str):
        given = [given]  # one module name (PEFT also takes a regular expression: refused below)
    if not isinstance(given, list) or not given or not all(isinstance(t, str) for t in given):
        raise AdapterError(f"adapter {name!r}: target_modules must be a list of module names, got {given!r}")
    unsupported = sorted(set(given) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise AdapterError(
            f"adapter {name!r}: target modules {', '.join(unsupported)} are not supported "
            f"(supported: {', '.join(SUPPORTED_TARGETS)})"
        )
    return tuple(t for t in SUPPORTED_TARGETS if t in given)


def base_targets(architecture: str) -> tuple[str, ...]:
    """The modules an adapter of a base model of `architecture` may target: those of its
    transformers model (Phi-3's fused qkv_proj and gate_up_proj, the others' split projections)."""
    return FUSED_TARGETS if architecture in FUSED_ARCHITECTURES else SPLIT_TARGETS


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """One `--lora-modules` item: NAME=PATH, or vLLM's JSON object {"name", "path",
    "base_model_name"}; (name, path, base model name or None). Raises ValueError."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules item {text!r} is not valid JSON: {e}") from None
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules item {text!r} needs a name and a path")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules item {text!r}: base_model_name must be a string")
        return name, path, base
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"--lora-modules item {text!r} must be NAME=PATH or a JSON object")
    return name, path, None


def startup_adapters(items: tuple[str, ...] | None) -> list[LoraRequest]:
    """The `--lora-modules` adapters, ids 1..N in order: the engine core and the server build the
    same list from the same arguments."""
    return [
        LoraRequest(name, lora_id, path, base)
        for lora_id, (name, path, base) in enumerate(map(parse_lora_module, items or ()), start=1)
    ]


class AdapterRegistry:
    """The adapters an engine serves, by name, with their ids (one id counter for its life)."""

    def __init__(self, startup: list[LoraRequest] | None = None) -> None:
        self._by_name = {lora.name: lora for lora in startup or ()}
        self._ids = itertools.count(max((lora.lora_id for lora in startup or ()), default=0) + 1)
        self.version = self._digest()

    def new(self, name: str, path: str, base_model_name: str | None = None) -> LoraRequest:
        """A request for a new adapter, not registered yet (see `add`)."""
        return LoraRequest(name, next(self._ids), path, base_model_name)

    def add(self, lora: LoraRequest) -> None:
        self._by_name[lora.name] = lora
        self.version = self._digest()

    def remove(self, name: str) -> LoraRequest | None:
        lora = self._by_name.pop(name, None)
        self.version = self._digest()
        return lora

    def _digest(self) -> str:
        """A short hash of the served (name, id) pairs: it changes with every load and unload (ids
        are never reused, so unloading and reloading a name changes it too), and an engine started
        again with the same `--lora-modules` has the same one."""
        served = sorted((lora.name, lora.lora_id) for lora in self._by_name.values())
        return hashlib.sha256(json.dumps(served).encode()).hexdigest()[:12]

    def get(self, name: str) -> LoraRequest | None:
        return self._by_name.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def all(self) -> list[LoraRequest]:
        return list(self._by_name.values())
