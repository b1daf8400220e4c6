"""A tokenizer for the simulated engine from a checkpoint's tokenizer.json and chat templates, with
the Hugging Face `tokenizers` library and jinja2 alone: transformers imports torch, the simulator
must not (64 replicas share one process and one tokenizer)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from corral_engine.chat_template import template_environment
from corral_engine.errors import ModelLoadError

# Where transformers' save_pretrained (>= 4.43) writes templates instead of tokenizer_config.json:
# the default one in the file, other named ones as NAME.jinja in the folder.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class LightTokenizer:
    """The part of a transformers tokenizer the server and the output processor call: `encode`,
    `decode`, `apply_chat_template`, a pair's encoding (calling it), and `backend_tokenizer` for
    their fast paths."""

    clean_up_tokenization_spaces = False  # lets the detokenizer call the Rust decode directly
    split_special_tokens = False

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json (the simulator reads only that format)")
        try:
            self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # `tokenizers` raises a bare Exception for unparsable files
            raise ModelLoadError(f"{path / 'tokenizer.json'} is not a valid tokenizer: {e}") from e
        config = read_json_object(path / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        saved = _template_files(path)
        self.chat_template = _chat_templates(config.get("chat_template")) if saved is None else saved
        self.eos_token_id = self.backend_tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self.backend_tokenizer.get_vocab_size()
        self._template: Any = None
        self._source: str | None = None  # the template _template was compiled from
        self._truncating: Any = None  # a copy that cuts pairs (its settings change per call)
        self._truncating_lock = threading.Lock()  # tokenizing may run off the event loop

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(
        self, text: str, text_pair: str | None = None, truncation: bool = False, max_length: int | None = None
    ) -> dict[str, list[int]]:
        """A text's, or a pair's, input_ids and token_type_ids, as a transformers tokenizer gives
        them (/v1/score's pairs); `truncation` to `max_length` tokens by the Rust tokenizer's
        longest_first, as transformers' fast tokenizers cut (on a copy: the shared one stays as is)."""
        if not truncation or max_length is None:
            encoded = self.backend_tokenizer.encode(text, text_pair)
        else:
            with self._truncating_lock:
                if self._truncating is None:
                    self._truncating = type(self.backend_tokenizer).from_str(self.backend_tokenizer.to_str())
                self._truncating.enable_truncation(max_length, strategy="longest_first")
                encoded = self._truncating.encode(text, text_pair)
        return {"input_ids": list(encoded.ids), "token_type_ids": list(encoded.type_ids)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """As transformers decodes: special tokens kept unless told (/tokenize's token_strs,
        /detokenize and logprobs' token texts call it so, as on the engine)."""
        return str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """As transformers renders it: `chat_template` in place of the tokenizer's; `tools` and any
        other keyword (chat_template_kwargs) reach the template as variables."""
        source = _pick_template(self.chat_template, chat_template, tools)
        if self._template is None or self._source != source:
            self._template, self._source = template_environment().from_string(source), source
        text = str(
            self._template.render(
                {
                    "bos_token": self.bos_token or "",
                    "eos_token": self.eos_token or "",
                    **template_kwargs,
                    "messages": messages,
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _template_files(model_dir: Path) -> str | dict[str, str] | None:
    """The templates saved as files, which replace tokenizer_config.json's entry whole when any
    exists, as transformers loads them: a folder template named "default" wins over the file."""
    paths = {"default": model_dir / CHAT_TEMPLATE_FILE} if (model_dir / CHAT_TEMPLATE_FILE).is_file() else {}
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        paths |= {p.name.removesuffix(".jinja"): p for p in (model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")}
    templates = {name: _read_template(p) for name, p in paths.items()}
    if list(templates) == ["default"]:
        return templates["default"]
    return templates or None


def _read_template(path: Path) -> str:
    """A template file's text, read as transformers reads it (UTF-8, universal newlines)."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} cannot be read as a chat template: {e}") from e


def _chat_templates(value: Any) -> str | dict[str, str] | None:
    """tokenizer_config.json's `chat_template`: one template, or transformers' list of named ones
    ({"name", "template"} each), read as a name -> template dict as transformers reads it."""
    if isinstance(value, list):
        return {str(t["name"]): str(t["template"]) for t in value if isinstance(t, dict) and "name" in t}
    return value if isinstance(value, str) else None


def _pick_template(
    own: str | dict[str, str] | None, chat_template: str | None, tools: list[dict[str, Any]] | None
) -> str:
    """The template a render uses, chosen as transformers' `get_chat_template` chooses it: the one
    given (a template, or the name of one of the tokenizer's), else the tokenizer's; of named
    ones "tool_use" where tools are given and it exists, else "default"."""
    if isinstance(own, dict):
        if chat_template is not None:
            return own.get(chat_template, chat_template)
        if tools is not None and "tool_use" in own:
            return own["tool_use"]
        if "default" in own:
            return own["default"]
        raise ValueError(f"this tokenizer's chat templates {sorted(own)} name no default")
    source = chat_template or own
    if source is None:
        raise ValueError("this tokenizer has no chat template")
    return source


def read_json_object(config_path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, tokenizer_config.json) as a dict ({} when absent);
    ModelLoadError when it is not a JSON object."""
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_path} cannot be read as JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} is not a JSON object")
    return config


def _token_text(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return str(token.get("content"))
    return token if isinstance(token, str) else None
