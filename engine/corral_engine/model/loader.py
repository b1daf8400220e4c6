"""Load a Hugging Face checkpoint (safetensors, else PyTorch pickles; sharded or not) into the
engine's model; under tensor parallelism each rank reads only its own slices (safetensors'
get_slice). FP8 checkpoints' weights are dequantized tensor by tensor, and quantized layers'
weights quantized row by row."""

from __future__ import annotations

import json
import logging
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from corral_engine.errors import ModelLoadError
from corral_engine.model.config import ModelConfig
from corral_engine.model.int_weights import check_plain, is_int_part, load_int_weights
from corral_engine.model.llama import CausalLM, FusedLinear, Linear
from corral_engine.model.moe import Experts
from corral_engine.model.parallel import EXPERT_PARTS, Cut, ShardPlan
from corral_engine.model.quant import QuantConfig
from corral_engine.model.quant_ops import CHECKPOINT_DTYPES, dequantize, quantize_rows
from corral_engine.qwen_vision_config import QWEN_VL_ARCHITECTURES
from corral_engine.weight_files import INDEXES, is_weight_file, weight_format

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# vLLM's per-tensor KV-cache scales (self_attn.k_scale / v_scale; older checkpoints: kv_scale):
# skipped, not refused; an fp8 KV cache here always uses scale 1.0 (logged when a checkpoint has them).
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
# A multimodal checkpoint served as its text model: where its decoder's tensors sit (hub files
# from transformers v4 save `language_model.model.*`, v4.52 and later `model.language_model.*`)
# and which prefixes hold the parts a text-only engine does not load.
_TEXT_MODEL_PREFIXES = {
    "Gemma3ForConditionalGeneration": (
        (("language_model.model.", "model.language_model."), "model."),
        (("language_model.lm_head.",), "lm_head."),
    ),
}
_NOT_TEXT_PREFIXES = {
    "Gemma3ForConditionalGeneration": (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    ),
}
# Longest first where one prefix starts another.
_LLAVA_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_QWEN_VL_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))  # v5; hub's: ours
# One expert's projection as hub checkpoints (and transformers' save_pretrained) hold them: Mixtral's
# block_sparse_moe.experts.N.w1 (gate) / w3 (up) / w2 (down), Qwen3-MoE's mlp.experts.N.gate_proj /
# up_proj / down_proj. transformers v5's fused in-memory layout (mlp.experts.gate_up_proj, [E, 2I, H])
# needs no mapping: those are this engine's parameter names.
_EXPERT = re.compile(
    r"^(?P<layer>.+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    rf"(?P<proj>{'|'.join(EXPERT_PARTS)})\.weight$"
)


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors (every shard its index names), else PyTorch's
    pickled `pytorch_model*.bin` (vLLM's --load-format auto), read with weights_only."""
    kind = weight_format(p.name for p in path.iterdir()) if path.is_dir() else None
    if kind is None:
        raise ModelLoadError(f"{path} has no weights: no *.safetensors and no pytorch_model*.bin files")
    index = path / INDEXES[kind]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed: {e}") from e
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(p for p in path.iterdir() if is_weight_file(p.name, kind))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"checkpoint shards listed in the index are missing: {', '.join(missing)}")
    return files


Slicer = Callable[[str], Cut | list[Cut] | bool | None]


def iter_tensors(files: list[Path], slicer: Slicer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, or with `slicer` only the part it names for each: (dim,
    start, length) reads that range of dimension `dim` from the file, several such pieces are read
    and concatenated; None the whole tensor; False skips it."""
    for file in files:
        if file.suffix == ".bin":
            yield from _pickled_tensors(file, slicer)
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    cut = None if slicer is None else slicer(name)
                    if cut is False:
                        continue
                    if cut is None or cut is True:
                        yield name, f.get_tensor(name)
                        continue
                    yield name, read_cut(f.get_slice(name), cut)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{file}: cannot read safetensors: {e}") from e


def _pickled_tensors(file: Path, slicer: Slicer | None) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_tensors for a `pytorch_model*.bin`: loaded with weights_only (tensors, never code),
    memory-mapped where the file is a zip archive (torch.save's format since 1.6), then cut."""
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)  # the legacy format
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ModelLoadError(f"{file}: cannot read PyTorch weights: {e}") from e
    if not isinstance(state, dict):
        raise ModelLoadError(f"{file}: holds a {type(state).__name__}, not a state dict of tensors")
    for name, tensor in state.items():
        cut = None if slicer is None else slicer(name)
        if cut is False:
            continue
        yield name, tensor if cut is None or cut is True else read_cut(tensor, cut).clone()


def read_cut(part: Any, cut: Cut | list[Cut]) -> torch.Tensor:
    """The ranges `cut` names of a safetensors slice (or a tensor), read from the file (never the
    whole tensor)."""
    pieces = cut if isinstance(cut, list) else [cut]
    read = [part[(slice(None),) * dim + (slice(start, start + length),)] for dim, start, length in pieces]
    return read[0] if len(read) == 1 else torch.cat(read, dim=pieces[0][0])


def llava_name(name: str, prefixes: tuple[tuple[str, str], ...] = _LLAVA_PREFIXES) -> str:
    """A LLaVA checkpoint's tensor under the engine's names (`model.*` for the text decoder,
    `lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`), from transformers v5's layout
    (`model.language_model.*`, `model.vision_tower.*`) or the hub's older one
    (`language_model.model.*`, `vision_tower.vision_model.*`); Qwen-VL's by `_QWEN_VL_PREFIXES`."""
    for prefix, replacement in prefixes:
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


def engine_name(name: str, architecture: str) -> str | None:
    """The engine's name for checkpoint tensor `name`, or None for one it does not load (a
    multimodal checkpoint's vision tower and projector)."""
    if architecture == "LlavaForConditionalGeneration":
        return llava_name(name)
    if architecture in QWEN_VL_ARCHITECTURES:
        return llava_name(name, _QWEN_VL_PREFIXES)
    if name.startswith(_NOT_TEXT_PREFIXES.get(architecture, ())):
        return None
    for prefixes, replacement in _TEXT_MODEL_PREFIXES.get(architecture, ()):
        for prefix in prefixes:
            if name.startswith(prefix):
                return replacement + name.removeprefix(prefix)
    return name


def pooling_name(name: str, architecture: str) -> str | None:
    """`engine_name` for an embedding model's decoder (no LM head): its LM head, if the checkpoint
    has one, is not loaded, and a base model's tensors (`layers.0...`, as AutoModel saves them and
    Qwen3-Embedding ships them) sit under `model.`."""
    ours = engine_name(name, architecture)
    if ours is None or ours.startswith("lm_head."):
        return None
    return ours if ours.startswith("model.") else "model." + ours


def _fused_target(name: str) -> tuple[str, str] | None:
    """Map `...self_attn.q_proj.weight` to (`...self_attn.qkv_proj.weight`, `q_proj`)."""
    for fused, shards in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        for shard in shards:
            marker = f".{shard}."
            if marker in name:
                return name.replace(marker, f".{fused}."), shard
    return None


def _expert_target(
    name: str, modules: dict[str, torch.nn.Module], params: dict[str, torch.nn.Parameter]
) -> tuple[torch.Tensor, str] | None:
    """Per-expert tensor `name` -> (its rows of the fused expert parameter, the loaded key); None
    for any other tensor."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix = f"{match['layer']}.mlp.experts"
    module = modules.get(prefix)
    if not isinstance(module, Experts):
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint: that layer has no experts")
    expert, part = int(match["expert"]), EXPERT_PARTS[match["proj"]]
    num_experts = module.gate_up_proj.shape[0]
    if expert >= num_experts:
        raise ModelLoadError(f"tensor {name!r} names expert {expert}; the config has {num_experts} experts")
    if part == "down":
        return params[f"{prefix}.down_proj"][expert], f"{prefix}.down_proj:{expert}"
    start = 0 if part == "gate" else module.size
    dest = params[f"{prefix}.gate_up_proj"][expert, start : start + module.size]
    return dest, f"{prefix}.gate_up_proj:{expert}:{part}"


def _expert_keys(name: str, module: Experts) -> set[str]:
    """The per-expert keys that together fill parameter `name` of `module`."""
    experts = range(module.gate_up_proj.shape[0])
    if name.endswith(".down_proj"):
        return {f"{name}:{e}" for e in experts}
    return {f"{name}:{e}:{part}" for e in experts for part in ("gate", "up")}


def load_weights(
    model: CausalLM, config: ModelConfig, plan: ShardPlan | None = None, quant: QuantConfig | None = None
) -> None:
    """Fill `model`'s parameters from the checkpoint: all of them, or this rank's shards (`plan`);
    `quant`: how the checkpoint's weights are stored (fp8 ones are dequantized as they are read)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    expected = {n for n in params if not (config.tie_word_embeddings and n == "lm_head.weight")}
    loaded: set[str] = set()
    num_kv_scales = 0
    files = checkpoint_files(config.path)
    is_int = quant is not None and quant.is_int
    scales = {} if is_int else _read_scales(files, quant)
    suffix = None if quant is None or quant.checkpoint is None or is_int else "." + quant.scale_suffix

    skipped: list[str] = []  # not the text model's (a multimodal checkpoint's vision tensors)
    is_pooling = model.lm_head is None
    rename = pooling_name if is_pooling else engine_name

    def slicer(name: str) -> Cut | list[Cut] | bool | None:
        if suffix is not None and name.endswith(suffix):
            return False  # read whole beforehand (_read_scales)
        if quant is not None and is_int:
            if is_int_part(name, quant):
                return False  # read module by module below (load_int_weights)
            check_plain(name, quant)
        ours = rename(name, config.architecture)
        if ours is None:
            if engine_name(name, config.architecture) is None:
                skipped.append(name)
            return False
        if is_int and ours.endswith(".bias") and not _has_param(ours, params):
            return False  # GPTQ tools save a zero bias for every quantized module; vLLM skips them too
        return None if plan is None else plan.checkpoint_slice(ours)

    with torch.no_grad():
        for checkpoint_name, tensor in iter_tensors(files, slicer):
            if checkpoint_name.endswith(_IGNORED_SUFFIXES):
                continue
            if checkpoint_name.endswith(_KV_SCALE_SUFFIXES):
                num_kv_scales += 1
                continue
            if tensor.dtype in CHECKPOINT_DTYPES:
                tensor = _dequantized(checkpoint_name, tensor, scales, quant, plan)
            name = rename(checkpoint_name, config.architecture) or checkpoint_name
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
            expert = _expert_target(name, modules, params)
            target = None if expert is not None else _fused_target(name)
            if expert is not None:
                dest, key = expert
            elif target is not None:
                fused_name, shard = target
                module = modules.get(fused_name.rsplit(".", 1)[0])
                param = params.get(fused_name)
                if not isinstance(module, FusedLinear) or param is None:
                    raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
                offset, size = module.shard_offsets[shard]
                dest = param[offset : offset + size]
                key = f"{fused_name}:{shard}"
            else:
                found = params.get(name)
                if found is None:
                    raise ModelLoadError(
                        f"unexpected tensor {name!r} in checkpoint for {config.architecture}"
                    )
                dest, key = found, name
                if plan is not None and _is_vocab(name) and tensor.shape[0] < dest.shape[0]:
                    dest.zero_()  # the last rank's padding rows: zero embeddings, never-read logits
                    dest = dest[: tensor.shape[0]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}"
                )
            _fill(dest, tensor, modules.get(key.split(":")[0].rsplit(".", 1)[0]), key)
            loaded.add(key)
    if quant is not None and is_int:
        dtype = model.model.norm.weight.dtype

        def int_rename(name: str) -> str | None:
            return rename(name, config.architecture)

        loaded |= load_int_weights(files, quant, int_rename, plan, modules, dtype)
    if skipped:
        logger.info(
            "%s: serving the text model only; %d vision tower and projector tensors not loaded",
            config.architecture,
            len(skipped),
        )
    missing = sorted(_missing(expected, loaded, modules))
    if missing:
        raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(missing[:8])}")
    if num_kv_scales:
        logger.warning(
            "the checkpoint's %d KV-cache scales (k_scale, v_scale) are not applied: an fp8 KV cache "
            "(--kv-cache-dtype) stores K and V with scale 1.0",
            num_kv_scales,
        )


def _fill(dest: torch.Tensor, tensor: torch.Tensor, module: torch.nn.Module | None, key: str) -> None:
    """Copy `tensor` into `dest`; for a quantized layer's weight (or a fused shard of it,
    `key` ...:shard), quantize it row by row and set those rows' scales."""
    if not isinstance(module, Linear) or module.quant is None or not key.split(":")[0].endswith(".weight"):
        dest.copy_(tensor)
        return
    q, scale = quantize_rows(tensor, dest.dtype)
    dest.copy_(q)
    offset, size = (0, dest.shape[0])
    if isinstance(module, FusedLinear) and ":" in key:
        offset, size = module.shard_offsets[key.split(":")[1]]
    module.get_buffer("weight_scale")[offset : offset + size].copy_(scale)


def _read_scales(files: list[Path], quant: QuantConfig | None) -> dict[str, torch.Tensor]:
    """An fp8 checkpoint's scale tensors, whole, by the weight they scale (a block's scale covers
    rows of several ranks, so each rank reads them all: 1/16384 of the weights at 128x128)."""
    if quant is None or quant.checkpoint is None:
        return {}
    suffix = "." + quant.scale_suffix

    def only_scales(name: str) -> bool | None:
        return None if name.endswith(suffix) else False

    return {name.removesuffix(suffix) + ".weight": t for name, t in iter_tensors(files, only_scales)}


def _dequantized(
    name: str,
    tensor: torch.Tensor,
    scales: dict[str, torch.Tensor],
    quant: QuantConfig | None,
    plan: ShardPlan | None,
) -> torch.Tensor:
    """An fp8 checkpoint tensor (this rank's slice of it) as float32, by its scale."""
    if quant is None or quant.checkpoint is None:
        raise ModelLoadError(f"tensor {name!r} is {tensor.dtype} but config.json has no quantization_config")
    scale = scales.get(name)
    if scale is None:
        raise ModelLoadError(f"fp8 tensor {name!r} has no {quant.scale_suffix} in the checkpoint")
    cut = None if plan is None else plan.checkpoint_slice(name)
    if tensor.dim() != 2:
        raise ModelLoadError(f"fp8 tensor {name!r}: only 2-D dense projections are supported")
    if isinstance(cut, list):  # a fused tensor's parts (Phi-3's qkv_proj), each from its own rows
        pieces = tensor.split([length for _, _, length in cut])
        parts = zip(pieces, cut, strict=True)
        return torch.cat([dequantize(p, scale, quant.block_size, c, name) for p, c in parts])
    return dequantize(tensor, scale, quant.block_size, cut if isinstance(cut, tuple) else None, name)


def _has_param(name: str, params: dict[str, torch.nn.Parameter]) -> bool:
    target = _fused_target(name)
    return (target[0] if target is not None else name) in params


def _is_vocab(name: str) -> bool:
    return name in ("model.embed_tokens.weight", "lm_head.weight")


def _missing(expected: set[str], loaded: set[str], modules: dict[str, torch.nn.Module]) -> set[str]:
    out = set()
    for name in expected:
        module = modules.get(name.rsplit(".", 1)[0])
        if isinstance(module, Experts) and name not in loaded:  # whole, or expert by expert
            out |= _expert_keys(name, module) - loaded
        elif isinstance(module, FusedLinear) and name not in loaded:  # whole (Phi-3), or shard by shard
            out |= {f"{name}:{s}" for s in module.shard_offsets if f"{name}:{s}" not in loaded}
        elif name not in loaded:
            out.add(name)
    return out
