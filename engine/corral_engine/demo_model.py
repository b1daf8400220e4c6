"""Write random-weight Hugging Face checkpoints (model + locally trained tokenizer) for tests, demos
and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a corpus generated from the seed,
the weights are drawn from a seeded generator one tensor at a time and written shard by shard. The
same seed on the same kind of device writes byte-identical files.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import shutil
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
from corral_engine.model.config import MOE_ARCHITECTURES, sparse_layers

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "build_config_dict",
    "count_parameters",
    "plan_shards",
    "preset_config",
    "shard_file_names",
    "write_demo_model",
]

PRESETS = ("tiny", "small", "llama3-8b")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
MOE_ARCHS = ("mixtral", "qwen3-moe")
# transformers config classes not named after the model class (ForCausalLM -> Config otherwise).
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


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
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Mixture-of-experts archs: experts per layer, picked per token, and Qwen3-MoE's expert size
    # (Mixtral's experts take `intermediate_size`). 0: this preset has no MoE variant.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    # Largest safetensors file; bigger checkpoints are split into shards with an index, as HF does.
    max_shard_bytes: int | None = None


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
        num_experts=4,
        moe_intermediate_size=64,
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
        num_experts=4,
        moe_intermediate_size=768,
    ),
    # For GPU benchmarks: Llama-3-8B's shapes (8.03B parameters, 16 GB in bf16, untied LM head).
    # The tokenizer is trained to the full 128,256 entries (~6 s) rather than padding the embedding
    # past a smaller tokenizer, so every id the random weights pick decodes to text, as with the
    # real model, and detokenizing costs what it would there.
    "llama3-8b": Preset(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        initializer_range=0.02,
        lm_head_std=0.02,
        tie_word_embeddings=False,
        dtype="bfloat16",
        qwen3_head_dim=128,
        num_corpus_words=200_000,
        lexicon_size=220_000,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_shard_bytes=5_000_000_000,
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
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "tie_word_embeddings": p.tie_word_embeddings,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": p.dtype,
    }
    if arch == "mistral":
        cfg["sliding_window"] = None  # like Mistral v0.2+: full attention
    if arch in ("qwen3", "qwen3-moe"):
        cfg["head_dim"] = p.qwen3_head_dim
    if arch == "phi3":  # fused qkv_proj / gate_up_proj tensors; a window as Phi-3-mini-4k's
        cfg["sliding_window"] = p.max_position_embeddings // 8
    if arch == "gemma3":
        cfg.update(_gemma3_config(p))
    if arch == "gemma2":
        cfg.update(_gemma2_config(p))
    if arch == "granite":  # Granite 3.x's multipliers; the softmax scale 1 / head_dim, as theirs
        head_dim = p.hidden_size // p.num_attention_heads
        cfg.update(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0)
        cfg["attention_multiplier"] = 1.0 / head_dim
    if arch in MOE_ARCHS:
        if not p.num_experts:
            raise ValueError(f"preset {preset!r} has no mixture-of-experts variant (tiny and small do)")
        cfg["num_experts_per_tok"] = p.num_experts_per_tok
    if arch == "mixtral":
        cfg["num_local_experts"] = p.num_experts
        cfg["sliding_window"] = None
    if arch == "qwen3-moe":  # every layer sparse, top-k renormalised: as Qwen3-30B-A3B
        cfg.update(num_experts=p.num_experts, moe_intermediate_size=p.moe_intermediate_size)
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    cfg.update(copy.deepcopy(config_overrides or {}))  # transformers mutates nested dicts it is given
    return cfg


def _gemma3_config(p: Preset) -> dict[str, Any]:
    """Gemma 3's shape at the preset's size (gemma-3-1b-it's rules): an explicit head_dim, the
    softmax scale from query_pre_attn_scalar (here hidden / heads, as Gemma 3 27B's, so it differs
    from head_dim), five sliding layers to a global one (at least one global), local and global
    rope bases, tied embeddings. The window is short, so test prompts pass it."""
    pattern = min(6, p.num_hidden_layers)
    return {
        "head_dim": p.qwen3_head_dim,
        "query_pre_attn_scalar": p.hidden_size // p.num_attention_heads,
        "sliding_window": p.max_position_embeddings // 32,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(p.num_hidden_layers)
        ],
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "tie_word_embeddings": True,
    }


def _gemma2_config(p: Preset) -> dict[str, Any]:
    """Gemma 2's shape at the preset's size: Gemma 3's head and scale rules, sliding and global
    layers alternating, one rope base. The soft-caps are lower than gemma-2's 50 (scores) and 30
    (logits), so a tiny random model's scores and logits reach them and a missing cap shows."""
    return {
        "head_dim": p.qwen3_head_dim,
        "query_pre_attn_scalar": p.hidden_size // p.num_attention_heads,
        "sliding_window": p.max_position_embeddings // 32,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p.num_hidden_layers)
        ],
        "attn_logit_softcapping": 10.0,
        "final_logit_softcapping": 15.0,
        "tie_word_embeddings": True,
    }


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
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
        attn += 2 * head_dim  # q_norm, k_norm
    if arch == "Olmo2ForCausalLM":
        attn += q + kv  # q_norm, k_norm over the whole projections
    num_norms = 4 if arch in ("Gemma3ForCausalLM", "Gemma2ForCausalLM") else 2  # Gemma's pre/post MLP norms
    num_layers = int(config["num_hidden_layers"])
    mlps = [3 * h * int(config["intermediate_size"])] * num_layers
    if arch in MOE_ARCHITECTURES:
        mlps = _moe_mlp_parameters(config, arch, h, num_layers)
    embeddings = v * h * (1 if config.get("tie_word_embeddings") else 2)
    return sum(mlps) + num_layers * (attn + num_norms * h) + embeddings + h


def _moe_mlp_parameters(config: dict[str, Any], arch: str, h: int, num_layers: int) -> list[int]:
    """Per layer: the router and experts' parameters, or the dense MLP's (Qwen3-MoE's MLP-only layers)."""
    num_experts = int(config.get("num_local_experts") or config["num_experts"])
    if arch == "MixtralForCausalLM":
        return [num_experts * (3 * h * int(config["intermediate_size"]) + h)] * num_layers
    step, dense = int(config.get("decoder_sparse_step", 1)), config.get("mlp_only_layers") or []
    sparse = num_experts * (3 * h * int(config["moe_intermediate_size"]) + h)
    mlp = 3 * h * int(config["intermediate_size"])
    return [sparse if is_sparse else mlp for is_sparse in sparse_layers(num_layers, step, dense)]


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names, in the order given, grouped into consecutive shards of at most `max_shard_bytes`
    each (a tensor larger than that gets a shard of its own); one shard when there is no limit."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, num_bytes in sizes:
        if max_shard_bytes is not None and shards[-1] and used + num_bytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += num_bytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """HF's names: model.safetensors alone, else model-0000i-of-0000n.safetensors."""
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def _meta_model(cfg: dict[str, Any]) -> Any:
    """The transformers model on the meta device: its config, parameter names and shapes, no memory.

    Only parameters are saved, so buffers (never initialised here) do not matter."""
    import torch
    import transformers

    arch_class = cfg["architectures"][0]
    config_class = getattr(
        transformers, _CONFIG_CLASSES.get(arch_class, arch_class.replace("ForCausalLM", "Config"))
    )
    model_class = getattr(transformers, arch_class)
    kwargs = copy.deepcopy({k: v for k, v in cfg.items() if k not in ("architectures", "dtype")})
    config = config_class(**kwargs)
    config.architectures = [arch_class]
    with torch.device("meta"):
        model = model_class(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # one parameter, listed once by named_parameters
    return model


def _draw(name: str, shape: tuple[int, ...], gen: Any, std: float, p: Preset, device: Any) -> Any:
    """One float32 tensor. Norm weights and biases are random too (not 1 / 0), so an engine that drops
    them is caught. The untied lm_head has its own std (named_parameters lists a tied one once, as
    the embedding)."""
    import torch

    if "norm" in name:
        return 1.0 + 0.2 * (torch.rand(shape, generator=gen, device=device) - 0.5)
    if name == "lm_head.weight":
        return torch.randn(shape, generator=gen, device=device) * p.lm_head_std
    return torch.randn(shape, generator=gen, device=device) * std


def _write_weights(
    model: Any,
    out: pathlib.Path,
    seed: int,
    p: Preset,
    dtype: str,
    device: str,
    max_shard_bytes: int | None,
    steps: _Steps,
) -> None:
    """Draw every parameter in sorted-name order from one seeded generator on `device` (independent
    of transformers' own init), one shard at a time, so host memory holds at most one shard.
    Mixture-of-experts models are written whole by transformers' save_pretrained (see _save_moe)."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    shapes = {name: tuple(t.shape) for name, t in sorted(model.named_parameters(), key=lambda kv: kv[0])}
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    sizes = [(name, math.prod(shape) * itemsize) for name, shape in shapes.items()]
    shards = plan_shards(sizes, max_shard_bytes)
    files = shard_file_names(len(shards))
    std = float(getattr(model.config, "initializer_range", p.initializer_range))
    gen = torch.Generator(device=device).manual_seed(seed)
    if model.config.architectures[0] in MOE_ARCHITECTURES:
        steps.advance("writing the experts through save_pretrained")
        state = {n: _draw(n, shape, gen, std, p, device).to(torch_dtype).cpu() for n, shape in shapes.items()}
        _save_moe(model, state, out, max_shard_bytes)
        return
    weight_map: dict[str, str] = {}
    with torch.no_grad():
        for file, names in zip(files, shards, strict=True):
            steps.advance(f"writing {file}")
            state = {n: _draw(n, shapes[n], gen, std, p, device).to(torch_dtype).cpu() for n in names}
            save_file(state, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
            del state
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)


def _save_moe(model: Any, state: dict[str, Any], out: pathlib.Path, max_shard_bytes: int | None) -> None:
    """transformers v5 holds experts fused in memory ([E, 2I, H]); its save_pretrained writes them
    expert by expert under each model's hub names (Mixtral's block_sparse_moe.experts.N.w1/w2/w3,
    Qwen3-MoE's mlp.experts.N.gate_proj/up_proj/down_proj), the layout real checkpoints have."""
    if model.config.tie_word_embeddings:  # one drawn tensor (named_parameters lists it once) for both
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state, strict=True, assign=True)  # off the meta device, onto the drawn tensors
    if model.config.tie_word_embeddings:
        model.tie_weights()
    from transformers.utils import logging as hf_logging

    shard = f"{max_shard_bytes}B" if max_shard_bytes else "50GB"
    was_shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its own bar; this writer shows progress (or not) through _Steps
    try:
        model.save_pretrained(str(out), max_shard_size=shard)
    finally:
        if was_shown:
            hf_logging.enable_progress_bar()
    for weights in out.glob("*.safetensors"):  # save_pretrained's are owner-only; the rest are not
        shutil.copymode(out / "tokenizer.json", weights)


def write_demo_model(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    seed: int = 0,
    arch: str = "llama",
    config_overrides: dict[str, Any] | None = None,
    progress: bool = False,
    device: str = "cpu",
    max_shard_bytes: int | None = None,
    weights: bool = True,
    quantization: str | None = None,
) -> pathlib.Path:
    """Write a random-weight checkpoint of `arch` to `out_dir` and return its path.

    Files: config.json, model.safetensors (or shards and model.safetensors.index.json),
    generation_config.json, tokenizer.json, tokenizer_config.json. `device` is where the weights are
    drawn ("cuda" makes llama3-8b's 16 GB quick); each kind of device draws its own bytes.
    `max_shard_bytes` overrides the preset's largest safetensors file. `weights=False` writes the
    rest only, with neither torch nor transformers: all the simulated engine reads.
    `quantization="fp8"` writes the same weights as an FP8 checkpoint (demo_fp8.py; dense archs);
    "awq", "gptq" and "w4a16" as int4 weight-only ones (demo_int4.py).
    """
    p = preset_config(preset)
    cfg = build_config_dict(preset, arch, config_overrides)
    if quantization not in (None, "fp8", "awq", "gptq", "w4a16") or (quantization and arch in MOE_ARCHS):
        raise ValueError(
            f"--quantization {quantization} is for dense architectures, and fp8, awq, gptq or w4a16 only"
        )
    vocab_size = int(cfg["vocab_size"])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _Steps(progress, f"demo model ({preset}, {arch})") as steps:
        steps.advance("training tokenizer")
        style = tokenizer_style(arch)
        tok = train_tokenizer(seed, vocab_size, p.num_corpus_words, p.lexicon_size, style)
        tok.save(str(out / "tokenizer.json"), pretty=True)
        max_len = int(cfg["max_position_embeddings"])
        _write_json(out / "tokenizer_config.json", tokenizer_config(max_len, style))
        # Weights an earlier checkpoint left here (other shards, or an index naming them) would be
        # read with the new ones, or in their place.
        for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)
        config_json = cfg
        if weights:
            model = _meta_model(cfg)
            shard_limit = max_shard_bytes if max_shard_bytes is not None else p.max_shard_bytes
            _write_weights(model, out, seed, p, str(cfg["dtype"]), device, shard_limit, steps)
            config_json = model.config.to_diff_dict()
            config_json.pop("transformers_version", None)  # keep files identical across library versions
            config_json["dtype"] = cfg["dtype"]
            config_json["architectures"] = cfg["architectures"]
        if quantization == "fp8":
            from corral_engine.demo_fp8 import fp8_quantization_config, quantize_checkpoint

            if weights:
                steps.advance("quantizing to fp8")
                quantize_checkpoint(out)
            config_json["quantization_config"] = fp8_quantization_config()
        elif quantization is not None:
            from corral_engine.demo_int4 import group_size_for, quantization_config, write_int4

            if weights:
                steps.advance(f"quantizing to {quantization}")
                config_json["quantization_config"] = write_int4(out, quantization, config_json, device)
            else:
                dims = [int(cfg["hidden_size"]), int(cfg["intermediate_size"])]
                config_json["quantization_config"] = quantization_config(quantization, group_size_for(dims))
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
    """A few named steps shown with rich when asked (how many is known only once the weights are
    planned, so the bar counts time, not steps); silent otherwise."""

    def __init__(self, enabled: bool, title: str) -> None:
        self._enabled, self._title = enabled, title
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Steps:
        if self._enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=False
            )
            self._progress.start()
            self._task = self._progress.add_task(self._title, total=None)
        return self

    def advance(self, what: str) -> None:
        if self._progress is None:
            return
        self._progress.update(self._task, description=f"{self._title}: {what}")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.update(self._task, total=1, completed=1)
            self._progress.stop()
