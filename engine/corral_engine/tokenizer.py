"""Tokenizer loading and incremental detokenization with stop strings.

The detokenizer decodes a small window of tokens each step and emits only text that ends on a
complete character, so streamed pieces never split UTF-8, and their concatenation equals decoding
all output tokens at once. Text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral_engine.errors import ModelLoadError

# Prompt tokens decoded along with the output, so the first output token's leading space (and
# similar context-dependent decoding) comes out as it would in a full decode.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json or tokenizer.model")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {e}") from e


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """text -> ids as `tokenizer.encode(text)` gives them. For fast tokenizers that is the Rust
    tokenizer's own encode, called directly: transformers' wrapper costs several times the encode
    itself, on the server's event loop, for every request. Not when the Rust tokenizer carries
    truncation or padding settings (transformers resets them per call) or special tokens are split.
    Its batch form, with a batch of one: unlike `encode` it lets go of the GIL while it works, so a
    long prompt tokenized on the server's tokenizer thread does not stop the event loop."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and not getattr(tokenizer, "split_special_tokens", False)
    ):
        encode_batch = backend.encode_batch
        return lambda text: encode_batch([text], add_special_tokens=True)[0].ids
    return lambda text: list(tokenizer.encode(text))


def vocabulary(tokenizer: Any) -> dict[str, int] | None:
    """token text -> id, added tokens included; None for a tokenizer that has no table (the
    simulator's token-ids-only one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return dict(backend.get_vocab(with_added_tokens=True))
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return dict(get_vocab()) if get_vocab is not None else None


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens (BOS, EOS, control tokens such as `[TOOL_CALLS]`): text -> id;
    empty for one without a table. Read once per tokenizer: every request with a rule about them
    asks."""
    try:
        return _SPECIAL_TOKENS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: read each time
        return _read_special_tokens(tokenizer)
    found = _SPECIAL_TOKENS[tokenizer] = _read_special_tokens(tokenizer)
    return found


def _read_special_tokens(tokenizer: Any) -> dict[str, int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    added = backend.get_added_tokens_decoder() if backend is not None else None
    if added is None:
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {str(t.content): int(i) for i, t in added.items() if getattr(t, "special", False)}


_SPECIAL_TOKENS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


def _decoder(
    tokenizer: Any, skip_special_tokens: bool, spaced: bool, hidden_ids: frozenset[int]
) -> Callable[[list[int]], str]:
    """ids -> text as `tokenizer.decode(ids, skip_special_tokens=...)` gives it, `hidden_ids` left
    out first. For fast tokenizers without space clean-up that is the Rust tokenizer's own decode,
    called directly: transformers' wrapper around it costs ~5x the decode itself, and this runs
    twice per output token of every running sequence, on the step thread."""
    if hidden_ids:
        shown = _decoder(tokenizer, skip_special_tokens, spaced, frozenset())
        return lambda ids: shown([i for i in ids if i not in hidden_ids])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    # Only a slow tokenizer reads `spaces_between_special_tokens`; passed only when asked, as
    # duck-typed tokenizers (the simulator's, tests') take just skip_special_tokens.
    kwargs = {"skip_special_tokens": skip_special_tokens}
    if not spaced:
        kwargs["spaces_between_special_tokens"] = False
    return lambda ids: str(tokenizer.decode(ids, **kwargs))


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True, spaced: bool = True) -> str:
    """ids -> their text with a request's special-token settings (skip_special_tokens,
    spaces_between_special_tokens), as the detokenizer writes a reply's."""
    return _decoder(tokenizer, skip_special_tokens, spaced, frozenset())(ids)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        hidden_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`hidden_ids`: special tokens left out of a text that shows the others (see _decoder)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # output text so far, cut at a stop string when one matched
        self.num_emitted_chars = 0
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.holdback = self.max_stop_len - 1 if stop and not include_stop_str_in_output else 0
        self._decode = _decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens, hidden_ids)

    def add_token(self, token_id: int) -> str | None:
        """Append one output token; return the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None  # an incomplete character: wait for more bytes
        piece = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append(piece)

    def flush(self) -> None:
        """At the end (not at a stop string): emit whatever is pending, even an incomplete char."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text):
            self._append(new_text[len(prefix_text) :])
        self.prefix_offset = self.read_offset = len(self.ids)

    def _append(self, piece: str) -> str | None:
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += piece
        if not self.stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.holdback)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
