"""Turn a demo checkpoint (demo_model.py) into an embedding model's layout, as Qwen3-Embedding and
sentence-transformers publish them: modules.json with a Pooling module (last token, mean or CLS)
and a Normalize one, the decoder's tensors without the LM head and without the `model.` prefix
(AutoModel's names), and optionally config.json naming the base-model class (`Qwen3Model`)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

POOLING_MODES = ("lasttoken", "mean", "cls")
_MODE_KEYS = {
    "lasttoken": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_sentence_transformers_files(
    out: pathlib.Path, hidden_size: int, pooling: str, normalize: bool
) -> None:
    """modules.json and its modules' folders (0: the transformer here, 1_Pooling, 2_Normalize)."""
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {pooling!r}")
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (out / "2_Normalize").mkdir(parents=True, exist_ok=True)
    _write_json(out / "modules.json", modules)
    config: dict[str, Any] = {"word_embedding_dimension": hidden_size, "include_prompt": True}
    config |= {key: mode == pooling for mode, key in _MODE_KEYS.items()}
    config |= {"pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    _write_json(out / "1_Pooling" / "config.json", config)
    _write_json(out / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False})


def strip_lm_head(out: pathlib.Path) -> None:
    """Rewrite the safetensors files without the LM head and with AutoModel's names (no `model.`)."""
    from safetensors.torch import load_file, save_file

    renamed: dict[str, str] = {}
    for file in sorted(out.glob("*.safetensors")):
        state = load_file(str(file))
        kept = {
            name.removeprefix("model."): t for name, t in state.items() if not name.startswith("lm_head.")
        }
        save_file(kept, str(file), metadata={"format": "pt"})
        renamed.update(dict.fromkeys(kept, file.name))
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = renamed
        _write_json(index, data)


def make_embedding_model(
    out_dir: str | pathlib.Path,
    pooling: str = "lasttoken",
    normalize: bool = True,
    base_model_class: bool = False,
) -> pathlib.Path:
    """Turn the demo checkpoint in `out_dir` into an embedding model (see the module docstring).
    `base_model_class`: config.json names `<Family>Model`, which --runner auto serves as embeddings;
    else it keeps `<Family>ForCausalLM`, as Qwen3-Embedding does (served with --runner pooling)."""
    out = pathlib.Path(out_dir)
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    write_sentence_transformers_files(out, int(config["hidden_size"]), pooling, normalize)
    strip_lm_head(out)
    config["tie_word_embeddings"] = True  # no LM head of its own: transformers then expects none
    if base_model_class:
        config["architectures"] = [a.replace("ForCausalLM", "Model") for a in config["architectures"]]
    _write_json(config_file, config)
    return out
