"""Write random-weight encoder checkpoints (BERT, XLM-RoBERTa): embedding models in the
sentence-transformers layout, sequence classifiers (rerankers: cross-encoders with one label; or N
labels, LABEL_0.. as transformers names them) or token classifiers (N labels a token), with a
tokenizer trained locally on the demo corpus; nothing is downloaded, and the same seed writes the
same files."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from corral_engine.demo_encoder_tokenizer import encoder_tokenizer_config, train_encoder_tokenizer

__all__ = [
    "ENCODER_ARCHITECTURES",
    "RERANKER_ARCHITECTURES",
    "TOKEN_CLASSIFIER_ARCHITECTURES",
    "encoder_config_dict",
    "write_demo_encoder",
]

ENCODER_ARCHITECTURES = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel"}
# The cross-encoder class of each (as cross-encoder/ms-marco-MiniLM-L-6-v2 and bge-reranker ship).
RERANKER_ARCHITECTURES = {
    "bert": "BertForSequenceClassification",
    "xlm-roberta": "XLMRobertaForSequenceClassification",
}
# The token classifier of each (NER checkpoints: dslim/bert-base-NER, xlm-roberta-large-finetuned-conll03).
TOKEN_CLASSIFIER_ARCHITECTURES = {
    "bert": "BertForTokenClassification",
    "xlm-roberta": "XLMRobertaForTokenClassification",
}
# The tiny preset: for tests; float32 so the engine's hidden states can match transformers'.
_HIDDEN, _LAYERS, _HEADS, _INTERMEDIATE, _VOCAB = 64, 2, 4, 128, 1024
_INITIALIZER_RANGE = 0.2
_MAX_POSITIONS = 512  # tokens per sequence, both archs (XLM-RoBERTa's table has 2 more rows)
_MAX_SEQ_LENGTH = 256  # sentence-transformers truncates to this (all-MiniLM-L6-v2's)

# How each pools token states into a sentence vector: all-MiniLM-L6-v2 takes the mean, bge-m3 the
# first token's (CLS); both normalise.
_POOLING = {"bert": "pooling_mode_mean_tokens", "xlm-roberta": "pooling_mode_cls_token"}


def encoder_config_dict(arch: str) -> dict[str, Any]:
    """Keyword arguments of the transformers config class of the tiny `arch` encoder (pure)."""
    if arch not in ENCODER_ARCHITECTURES:
        raise ValueError(f"unknown encoder arch {arch!r}; supported: {', '.join(ENCODER_ARCHITECTURES)}")
    cfg: dict[str, Any] = {
        "hidden_size": _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": _HEADS,
        "intermediate_size": _INTERMEDIATE,
        "vocab_size": _VOCAB,
        "hidden_act": "gelu",
        "initializer_range": _INITIALIZER_RANGE,
    }
    if arch == "bert":  # as bert-base: 512 positions from 0, two token types
        return {**cfg, "max_position_embeddings": _MAX_POSITIONS, "type_vocab_size": 2, "pad_token_id": 0}
    # As XLM-RoBERTa: positions start past padding_idx 1 (514 rows for 512 tokens), one token type.
    return {
        **cfg,
        "max_position_embeddings": _MAX_POSITIONS + 2,
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "bos_token_id": 0,
        "pad_token_id": 1,
        "eos_token_id": 2,
    }


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _sentence_transformers_files(out: pathlib.Path, arch: str) -> None:
    """modules.json (transformer, pooling, normalize), the pooling config, sentence_bert_config.json."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    _write_json(out / "modules.json", modules)
    modes = (
        "pooling_mode_cls_token",
        "pooling_mode_mean_tokens",
        "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
        "pooling_mode_lasttoken",
    )
    pooling: dict[str, Any] = {mode: mode == _POOLING[arch] for mode in modes}
    pooling.update(word_embedding_dimension=_HIDDEN, include_prompt=True)
    (out / "1_Pooling").mkdir(exist_ok=True)
    _write_json(out / "1_Pooling" / "config.json", pooling)
    (out / "2_Normalize").mkdir(exist_ok=True)  # Normalize has no parameters: the folder is empty
    _write_json(
        out / "sentence_bert_config.json", {"max_seq_length": _MAX_SEQ_LENGTH, "do_lower_case": False}
    )


def _write_weights(
    out: pathlib.Path, arch: str, seed: int, num_labels: int, is_token_classifier: bool = False
) -> dict[str, Any]:
    """Draw every parameter of transformers' model (pooler included, as hub checkpoints hold it; a
    classifier's head with `num_labels` outputs, 0: none; on each token for a token classifier) in
    sorted-name order from one seeded generator and save them as model.safetensors; config.json's dict."""
    import torch
    import transformers
    from safetensors.torch import save_file

    kinds = TOKEN_CLASSIFIER_ARCHITECTURES if is_token_classifier else RERANKER_ARCHITECTURES
    class_name = (kinds if num_labels else ENCODER_ARCHITECTURES)[arch]
    model_class = getattr(transformers, class_name)
    extra = {"num_labels": num_labels} if num_labels else {}
    config = model_class.config_class(**encoder_config_dict(arch), **extra)
    config.architectures = [class_name]
    with torch.device("meta"):
        model = model_class(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        shape = tuple(param.shape)
        if "LayerNorm.weight" in name:  # near 1, not 1: an engine that drops the norm's scale is caught
            state[name] = 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
        else:  # biases too are non-zero, for the same reason
            state[name] = torch.randn(shape, generator=gen) * _INITIALIZER_RANGE
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_json = config.to_diff_dict()
    config_json.pop("transformers_version", None)  # files identical across library versions
    config_json.update(architectures=config.architectures, dtype="float32")
    return config_json


def write_demo_encoder(
    out_dir: str | os.PathLike[str],
    arch: str = "bert",
    seed: int = 0,
    is_reranker: bool = False,
    num_labels: int = 0,
    is_token_classifier: bool = False,
) -> pathlib.Path:
    """Write the tiny random-weight `arch` encoder to `out_dir` and return its path: config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json (BERT: vocab.txt too) and, for an
    embedding model, the sentence-transformers files (`is_reranker`: a one-label cross-encoder
    instead; `num_labels` N: a classifier of N labels, of each token with `is_token_classifier`)."""
    if arch not in ENCODER_ARCHITECTURES:
        raise ValueError(f"unknown encoder arch {arch!r}; supported: {', '.join(ENCODER_ARCHITECTURES)}")
    if num_labels < 0 or (is_reranker and num_labels not in (0, 1)):
        raise ValueError(f"num_labels {num_labels}: a classifier has 1 or more; a reranker has 1")
    if is_token_classifier and (is_reranker or num_labels < 1):
        raise ValueError("a token classifier needs num_labels (1 or more) and is not a reranker")
    num_labels = num_labels or int(is_reranker)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # an earlier checkpoint's weights would be read with these
    tok = train_encoder_tokenizer(arch, seed, _VOCAB)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", encoder_tokenizer_config(arch, _MAX_POSITIONS))
    if arch == "bert":  # BERT checkpoints carry the WordPiece vocabulary as text too
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        (out / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab), encoding="utf-8")
    _write_json(out / "config.json", _write_weights(out, arch, seed, num_labels, is_token_classifier))
    if not num_labels:  # a cross-encoder has no pooling modules: its head reads the first token
        _sentence_transformers_files(out, arch)
    return out
