"""Load a BERT-family encoder from a Hugging Face safetensors checkpoint (one file or sharded):
checkpoint tensor names mapped onto the Encoder's parameters, every tensor accounted for."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from corral_engine.errors import ModelLoadError
from corral_engine.model.encoder import Encoder
from corral_engine.model.encoder_config import EncoderConfig, load_encoder_config
from corral_engine.model.loader import checkpoint_files, iter_tensors

# Where a head model (BertForMaskedLM) or an older save keeps the encoder's tensors.
_PREFIXES = ("bert.", "roberta.")
# Not part of an embedding model: the pooler head (sentence-transformers pools the hidden states
# itself), BertForMaskedLM's prediction head, and buffers older transformers versions saved.
_SKIPPED_PREFIXES = ("pooler.", "cls.")
# A classifier's head (Encoder.classifier): BERT's pooler and classifier; RoBERTa's (and
# XLM-RoBERTa's) classifier, whose pooler, where a checkpoint holds one, is unused as in transformers.
_BERT_HEAD = {
    "pooler.dense.weight": "classifier.dense.weight",
    "pooler.dense.bias": "classifier.dense.bias",
    "classifier.weight": "classifier.out.weight",
    "classifier.bias": "classifier.out.bias",
}
_ROBERTA_HEAD = {
    "classifier.dense.weight": "classifier.dense.weight",
    "classifier.dense.bias": "classifier.dense.bias",
    "classifier.out_proj.weight": "classifier.out.weight",
    "classifier.out_proj.bias": "classifier.out.bias",
}


# A token classifier's head: one linear layer on each token, under the same name in every family.
_TOKEN_HEAD = {"classifier.weight": "classifier.out.weight", "classifier.bias": "classifier.out.bias"}


def head_names(config: EncoderConfig) -> dict[str, str]:
    """The classification head's checkpoint names -> the Encoder's (empty without a head)."""
    if not config.num_labels:
        return {}
    if config.is_token_classifier:
        return _TOKEN_HEAD
    return _BERT_HEAD if config.architecture.startswith("Bert") else _ROBERTA_HEAD


_SKIPPED_NAMES = ("embeddings.position_ids", "embeddings.token_type_ids")
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
}
_LAYER = re.compile(r"^encoder\.layer\.(?P<layer>\d+)\.(?P<part>.+)\.(?P<kind>weight|bias)$")
# A layer's checkpoint module -> (the Encoder's module, which third of the fused qkv rows or None).
_LAYER_PARTS = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("ffn_in", None),
    "output.dense": ("ffn_out", None),
    "output.LayerNorm": ("ffn_norm", None),
}


def load_encoder(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    config: EncoderConfig | None = None,
) -> tuple[EncoderConfig, Encoder]:
    """The checkpoint in `model_dir` as an Encoder in `dtype` on `device`, ready for inference
    (`config`: its EncoderConfig where already loaded); ModelLoadError naming an unsupported
    config, an unknown tensor or the missing ones."""
    if config is None:
        config = load_encoder_config(model_dir)
    with torch.device("meta"):
        model = Encoder(config)
    model = model.to(dtype).to_empty(device=device).eval()  # uninitialised: the checkpoint fills all
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    head = head_names(config)

    def is_read(name: str) -> bool | None:
        """iter_tensors' slicer: False for the tensors never loaded (not read from the file)."""
        stripped = _strip_prefix(name)
        if stripped in head:
            return None
        return False if stripped.startswith(_SKIPPED_PREFIXES) or stripped in _SKIPPED_NAMES else None

    with torch.no_grad():
        for name, tensor in iter_tensors(checkpoint_files(config.path), is_read):
            found = encoder_target(name, head)
            param = None if found is None else params.get(found[0])
            if found is None or param is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint for {config.architecture}")
            target, third = found
            dest = param if third is None else param.chunk(3)[third]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(target if third is None else f"{target}:{third}")
    expected = {n for n in params if not n.endswith(".qkv.weight") and not n.endswith(".qkv.bias")}
    expected |= {f"{n}:{i}" for n in params if ".qkv." in n for i in range(3)}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(
            f"checkpoint is missing tensors: {', '.join(_checkpoint_name(n, head) for n in missing[:8])}"
        )
    return config, model


def _strip_prefix(name: str) -> str:
    return next((name.removeprefix(p) for p in _PREFIXES if name.startswith(p)), name)


def encoder_target(name: str, head: dict[str, str] | None = None) -> tuple[str, int | None] | None:
    """Checkpoint tensor `name` -> (the Encoder parameter it fills, its third of the fused qkv
    rows or None); None for a name no BERT-family checkpoint holds. `head`: a classifier's head
    names (`head_names`)."""
    stripped = _strip_prefix(name)
    if head and stripped in head:
        return head[stripped], None
    # Checkpoints from before transformers renamed them hold LayerNorm.gamma / LayerNorm.beta.
    if stripped.endswith(".LayerNorm.gamma"):
        stripped = stripped.removesuffix("gamma") + "weight"
    elif stripped.endswith(".LayerNorm.beta"):
        stripped = stripped.removesuffix("beta") + "bias"
    if stripped in _EMBEDDINGS:
        return _EMBEDDINGS[stripped], None
    match = _LAYER.match(stripped)
    if match is None or match["part"] not in _LAYER_PARTS:
        return None
    module, third = _LAYER_PARTS[match["part"]]
    return f"layers.{match['layer']}.{module}.{match['kind']}", third


def _checkpoint_name(key: str, head: dict[str, str]) -> str:
    """A missing Encoder key as the checkpoint would name it (what a user can look for)."""
    target, _, third = key.partition(":")
    for name, ours in _EMBEDDINGS.items():
        if ours == target:
            return name
    for name, ours in head.items():
        if ours == target:
            return name
    _, layer, module, kind = target.split(".")
    for part, (ours, which) in _LAYER_PARTS.items():
        if ours == module and (which is None or str(which) == third):
            return f"encoder.layer.{layer}.{part}.{kind}"
    return target
