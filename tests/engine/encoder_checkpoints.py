"""Tiny BERT-family checkpoints written by transformers itself (random weights, float32), and
helpers to edit their safetensors, for the encoder tests."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

TINY = {
    "vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
}


def save_hf_encoder(
    path: pathlib.Path, model_class: str, seed: int = 0, max_shard_size: str = "50GB", **overrides: Any
) -> Any:
    """transformers' `model_class` (BertModel, BertForMaskedLM, RobertaModel, XLMRobertaModel) with
    random weights (norms and biases too) saved to `path`; returns the model in eval mode."""
    cls = getattr(transformers, model_class)
    config = cls.config_class(**{**TINY, **overrides})
    config.architectures = [model_class]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model


def edit_tensors(
    path: pathlib.Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    """Rewrite the single-file checkpoint at `path` with `edit` applied to its tensors."""
    tensors = load_file(path / "model.safetensors")
    save_file(edit(tensors), str(path / "model.safetensors"), metadata={"format": "pt"})


def edit_config(path: pathlib.Path, **fields: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def hidden_states(model: Any, ids: list[torch.Tensor]) -> torch.Tensor:
    """transformers' last hidden state of each sequence run alone, concatenated: [T, H]."""
    base = getattr(model, "bert", model)  # BertForMaskedLM's encoder
    with torch.no_grad():
        return torch.cat([base(input_ids=i[None]).last_hidden_state[0] for i in ids])
