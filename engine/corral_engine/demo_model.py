"""Write small random-weight Hugging Face checkpoints (model + locally trained tokenizer) for tests and demos.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a corpus generated from the seed,
the weights are drawn from a seeded generator. The same seed writes byte-identical files.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pathlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PRESETS = ("tiny", "small")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2 in this order
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

# Role-tagged turns; an assistant turn ends with eos so generation stops at the end of a reply.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


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

# Fixed English text so common words get their own tokens and demos read naturally.
_ENGLISH = """
The quick brown fox jumps over the lazy dog. A corral is a pen for keeping animals together,
and this project keeps a herd of language models together on a cluster of machines.
Every request arrives at the gateway, waits in a queue, and is sent to the replica with the most room.
The engine reads the prompt, fills its cache block by block, and writes one token at a time.
When memory runs short it pauses the newest request and picks it up again later.
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past nine.
One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 65536.
Please write a short story about a cat who learns to read. Once upon a time there was a small cat.
She found a book in the garden and opened it. The letters danced, and slowly they began to make sense.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n
{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
Summer, autumn, winter, spring. North, south, east, west. Red, green, blue, yellow, black, white.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber, stra\u00dfe.
\u4f60\u597d\uff0c\u4e16\u754c\u3002 \u3053\u3093\u306b\u3061\u306f\u3002 \U0001f600 \U0001f680 \u2764\ufe0f
"""

# The pre-tokenizer split of transformers' Qwen2Tokenizer (a behaviour, restated to match it).
_QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ENGLISH_REPEATS = 50  # weight the fixed text so its common words become tokens even in tiny vocabularies

# Pseudo-word parts; "" entries make empty onsets/codas more likely.
_ONSETS = [
    "",
    *"bcdfghjklmnprstvwz",
    "br",
    "ch",
    "cl",
    "dr",
    "fl",
    "gr",
    "kr",
    "pl",
    "pr",
    "sh",
    "sk",
    "st",
    "th",
]
_VOWELS = [*"aeiouy", "ai", "ea", "ee", "ie", "oa", "oo", "ou"]
_CODAS = ["", "", "", *"nrstlmx", "nd", "ng", "st", "rt", "ck", "sh"]
_PUNCT = [*"...,,!?;:"]


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


def synthetic_corpus(seed: int, num_words: int, lexicon_size: int) -> Iterator[str]:
    """Deterministic training text: fixed English plus Zipf-distributed seeded pseudo-words."""
    rng = random.Random(seed)
    for _ in range(_ENGLISH_REPEATS):
        yield from _ENGLISH.strip().splitlines()
    lexicon: list[str] = []
    seen: set[str] = set()
    while len(lexicon) < lexicon_size:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        if word not in seen:
            seen.add(word)
            lexicon.append(word)
    weights = [1.0 / (rank + 1) for rank in range(lexicon_size)]
    words = rng.choices(lexicon, weights=weights, k=num_words)
    # Every lexicon word at least twice, so the larger vocabularies have enough distinct merges.
    words += lexicon + lexicon
    rng.shuffle(words)
    line: list[str] = []
    for i, word in enumerate(words):
        if not line:
            word = word.capitalize()
        line.append(word)
        if rng.random() < 0.08:
            line[-1] += rng.choice(_PUNCT)
        if rng.random() < 0.02:
            line.append(str(rng.randrange(10_000)))
        if len(line) >= 12 or i == len(words) - 1:
            yield " ".join(line)
            line = []


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    # tokenizers reads this on each call; one thread keeps training independent of scheduling.
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def tokenizer_style(arch: str) -> str:
    """Qwen checkpoints load through transformers' Qwen2Tokenizer, which rebuilds a Qwen pipeline
    (NFC, Qwen split regex, no BOS); Qwen-arch demo models use that pipeline so every loader agrees."""
    return "qwen" if arch in ("qwen2", "qwen3") else "llama"


def train_tokenizer(
    seed: int, vocab_size: int, num_words: int, lexicon_size: int, style: str = "llama"
) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` entries (specials included)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _single_threaded_tokenizers():
        tok.train_from_iterator(synthetic_corpus(seed, num_words, lexicon_size), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer training reached {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    if style == "llama":
        # Like Llama: encoding adds BOS (the chat template writes it itself: render, then encode
        # without special tokens).
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
        )
    return tok


def _tokenizer_config(max_length: int, style: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "Qwen2Tokenizer" if style == "qwen" else "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,  # byte-level: every input is representable
        "add_bos_token": style == "llama",
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


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
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    tied = bool(getattr(config, "tie_word_embeddings", False))
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
        _write_json(out / "tokenizer_config.json", _tokenizer_config(max_len, style))
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
