"""Write small random-weight Hugging Face checkpoints (model + locally trained tokenizer) for tests and demos.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a corpus generated from the seed,
the weights are drawn from a seeded generator. The same seed writes byte-identical files.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from corral_engine.demo_tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    tokenizer_config,
    tokenizer_style,
    train_tokenizer,
)

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "build_config_dict",
    "count_parameters",
    "preset_config",
    "write_demo_model",
]

PRESETS = ("tiny", "small")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    initializer_range: float
    # std of the untied lm_head; tiny uses a large one so greedy top-1 logits are far from ties.
    lm_head_std: float
    tie_word_embeddings: bool
    dtype: str  # "float32" | "bfloat16": dtype of the saved weights
    qwen3_head_dim: int  # Qwen3 states head_dim explicitly; chosen != hidden/heads to exercise it
    num_corpus_words: int  # words of synthetic text the tokenizer is trained on
    lexicon_size: int  # distinct synthetic words


_PRESETS: dict[str, Preset] = {
    # For tests: fast to build and run; float32 so engine output can match transformers exactly.
    "tiny": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1024,
        max_position_embeddings=512,
        initializer_range=0.2,
        lm_head_std=0.5,
        tie_word_embeddings=False,
        dtype="float32",
        qwen3_head_dim=32,
        num_corpus_words=20_000,
        lexicon_size=3_000,
    ),
    # For benchmarks: a ~107M-parameter Llama (tied embeddings) shaped like llama2.c's stories110M
    # with grouped-query attention.
    "small": Preset(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2304,
        vocab_size=32000,
        max_position_embeddings=2048,
        initializer_range=0.02,
        lm_head_std=0.02,
        tie_word_embeddings=True,
        dtype="bfloat16",
        qwen3_head_dim=64,
        num_corpus_words=400_000,
        lexicon_size=60_000,
    ),
}


def preset_config(preset: str) -> Preset:
    """The named preset, or ValueError naming the supported ones."""
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; supported: {', '.join(PRESETS)}")
    return _PRESETS[preset]


def build_config_dict(
    preset: str = "tiny", arch: str = "llama", config_overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Keyword arguments for the transformers config class of `arch` (pure; no torch)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    p = preset_config(preset)
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "intermediate_size": p.intermediate_size,
        "vocab_size": p.vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": p.initializer_range,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": p.tie_word_embeddings,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": p.dtype,
    }
    if arch == "mistral":
        cfg["sliding_window"] = None  # like Mistral v0.2+: full attention
    if arch == "qwen3":
        cfg["head_dim"] = p.qwen3_head_dim
    cfg.update(copy.deepcopy(config_overrides or {}))  # transformers mutates nested dicts it is given
    return cfg


def count_parameters(config: dict[str, Any]) -> int:
    """Parameter count of a Llama-family model with this config dict (pure arithmetic)."""
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    n_heads, n_kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or h // n_heads)
    arch = config["architectures"][0]
    q, kv = n_heads * head_dim, n_kv * head_dim
    attn = h * q + 2 * h * kv + q * h
    if arch == "Qwen2ForCausalLM" or config.get("attention_bias"):
        attn += q + 2 * kv + (q if config.get("attention_bias") and arch != "Qwen2ForCausalLM" else 0)
    if arch == "Qwen3ForCausalLM":
        attn += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * h * int(config["intermediate_size"])
    layer = attn + mlp + 2 * h
    embeddings = v * h * (1 if config.get("tie_word_embeddings") else 2)
    return int(config["num_hidden_layers"]) * layer + embeddings + h


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _init_weights(model: Any, seed: int, p: Preset, tied: bool) -> None:
    """Seeded init in sorted-name order, independent of transformers' own init.

    Norm weights and biases are random too (not 1 / 0), so an engine that drops them is caught.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", p.initializer_range))
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                param.copy_(1.0 + 0.2 * (torch.rand(param.shape, generator=gen) - 0.5))
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            elif name == "lm_head.weight" and not tied:
                param.copy_(torch.randn(param.shape, generator=gen) * p.lm_head_std)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def _save_weights(model: Any, path: pathlib.Path, dtype: str, tied: bool) -> None:
    import torch
    from safetensors.torch import save_file

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    state = {
        name: t.detach().to(torch_dtype).contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(dict(sorted(state.items())), str(path), metadata={"format": "pt"})


def _build_model(cfg: dict[str, Any], seed: int, p: Preset) -> Any:
    import torch
    import transformers

    arch_class = cfg["architectures"][0]
    config_class = getattr(transformers, arch_class.replace("ForCausalLM", "Config"))
    model_class = getattr(transformers, arch_class)
    kwargs = copy.deepcopy({k: v for k, v in cfg.items() if k not in ("architectures", "dtype")})
    config = config_class(**kwargs)
    config.architectures = [arch_class]
    # Build without transformers' own (discarded) init; _init_weights fills every parameter. Only the
    # parameters are saved, so the non-persistent buffers left uninitialised here never matter.
    with torch.device("meta"):
        model = model_class(config)
    model = model.to_empty(device="cpu").to(torch.float32)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        model.tie_weights()  # to_empty allocates the shared tensor twice
    _init_weights(model, seed, p, tied)
    return model


def write_demo_model(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    seed: int = 0,
    arch: str = "llama",
    config_overrides: dict[str, Any] | None = None,
    progress: bool = False,
) -> pathlib.Path:
    """Write a random-weight checkpoint of `arch` to `out_dir` and return its path.

    Files: config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json.
    """
    p = preset_config(preset)
    cfg = build_config_dict(preset, arch, config_overrides)
    vocab_size = int(cfg["vocab_size"])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _Steps(progress, f"demo model ({preset}, {arch})", total=4) as steps:
        steps.advance("training tokenizer")
        style = tokenizer_style(arch)
        tok = train_tokenizer(seed, vocab_size, p.num_corpus_words, p.lexicon_size, style)
        tok.save(str(out / "tokenizer.json"), pretty=True)
        max_len = int(cfg["max_position_embeddings"])
        _write_json(out / "tokenizer_config.json", tokenizer_config(max_len, style))
        steps.advance("initializing weights")
        model = _build_model(cfg, seed, p)
        steps.advance("writing model.safetensors")
        tied = bool(model.config.tie_word_embeddings)
        _save_weights(model, out / "model.safetensors", str(cfg["dtype"]), tied)
        config_json = model.config.to_diff_dict()
        config_json.pop("transformers_version", None)  # keep files identical across library versions
        config_json["dtype"] = cfg["dtype"]
        config_json["architectures"] = cfg["architectures"]
        _write_json(out / "config.json", config_json)
        generation = {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
        }
        _write_json(out / "generation_config.json", generation)
        steps.advance("done")
    return out


class _Steps:
    """A few named steps shown with rich when asked; silent otherwise."""

    def __init__(self, enabled: bool, title: str, total: int) -> None:
        self._enabled, self._title, self._total = enabled, title, total
        self._progress: Any = None
        self._task: Any = None
        self._started = False

    def __enter__(self) -> _Steps:
        if self._enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=False
            )
            self._progress.start()
            self._task = self._progress.add_task(self._title, total=self._total)
        return self

    def advance(self, what: str) -> None:
        if self._progress is None:
            return
        self._progress.update(
            self._task, description=f"{self._title}: {what}", advance=1 if self._started else 0
        )
        self._started = True

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self._total)
            self._progress.stop()
