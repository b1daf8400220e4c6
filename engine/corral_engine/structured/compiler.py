"""Grammars compiled once per distinct spec (llguidance), and a fresh matcher per sequence.

A compiled grammar is kept as a matcher in its initial state; each constrained sequence gets a
`deep_copy` of it, which costs microseconds where compiling a schema costs milliseconds. The cache
is shared by the server's threads (requests are validated on the event loop), hence the lock.
Imports no torch (the server's side of the engine-core process compiles to check a request); the
step's token masks are `structured.masks`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from corral_engine.core.sequence import Request
from corral_engine.errors import InvalidRequestError
from corral_engine.structured.spec import GrammarSpec
from corral_engine.tokenizer import special_tokens

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's vocabulary)."""
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (a large vocabulary takes ~1 s)."""
        if self._ll_tokenizer is None:
            import llguidance

            backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise InvalidRequestError(
                    "structured outputs need a fast (tokenizer.json) tokenizer", "structured_outputs"
                )
            size = max(self._vocab_size, backend.get_vocab_size(with_added_tokens=True))
            self._ll_tokenizer = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=size, eos_token=self._eos_token_ids
            )
        return self._ll_tokenizer

    @property
    def is_used(self) -> bool:
        """Whether any request was constrained (the vocabulary was built for it)."""
        return self._ll_tokenizer is not None

    @property
    def mask_width(self) -> int:
        """int32 words in one sequence's token bitmask."""
        return (int(self.ll_tokenizer.vocab_size) + 31) // 32

    def attach(self, request: Request) -> None:
        """Give each of a constrained request's sequences its own grammar state (raises
        InvalidRequestError when the grammar does not compile)."""
        spec = request.params.grammar
        if spec is not None:
            for seq in request.seqs:
                seq.grammar = self.matcher(spec)

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh llguidance.LLMatcher for one sequence; InvalidRequestError when `spec` does not
        compile, with llguidance's reason."""
        with self._lock:
            proto = self._cache.get(spec)
            if proto is None:
                proto = self._compile(spec)
                self._cache[spec] = proto
                if len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
            return proto.deep_copy()

    def _compile(self, spec: GrammarSpec) -> Any:
        import llguidance

        what = _WHAT[spec.kind]
        try:
            grammar = _grammar_text(spec, special_tokens(self._hf_tokenizer))
        except ValueError as e:
            raise InvalidRequestError(f"Invalid {what}: {e}", spec.param) from e
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"Invalid {what}: {matcher.get_error()}", spec.param)
        self.num_compiled += 1
        return matcher


def _grammar_text(spec: GrammarSpec, specials: dict[str, int]) -> str:
    """The llguidance grammar for `spec` (`specials`: the tokenizer's special tokens, text -> id);
    ValueError when it cannot even be translated."""
    text = _constraint_text(spec)
    if spec.reasoning_end is None:
        return text
    return _after_reasoning(text, spec.reasoning_end, spec.reasoning_start, specials)


def _constraint_text(spec: GrammarSpec) -> str:
    import llguidance

    if spec.kind == "json":
        # Bounded whitespace: none between tokens unless the request gives a pattern, so a model
        # that favours spaces or newlines cannot pad a document past max_tokens.
        options: dict[str, Any] = (
            {"whitespace_flexible": False}
            if spec.whitespace_pattern is None
            else {"whitespace_pattern": spec.whitespace_pattern}
        )
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=options))  # type: ignore[arg-type]
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
    if spec.kind == "choice":
        return str(llguidance.grammar_from("choice", spec.text))
    return str(llguidance.grammar_from("grammar", spec.text))


_REASONING_GRAMMAR = "corral_reasoning"
# Between the block and the document: the blank lines reasoning models write there (Qwen3 and
# DeepSeek-R1 write two), bounded so that a constrained reply cannot pad itself to max_tokens.
_GAP = r"/[ \t\r\n]{0,4}/"


def _after_reasoning(text: str, end: str, start: str | None, specials: dict[str, int]) -> str:
    """A top-level llguidance grammar: a reasoning block (any text up to the first `end`; opened
    by `start` where given, and then optional), a short gap, then the grammar `text` (a top-level
    grammar's JSON, or lark). The block is one lexeme that cannot hold `end` before its own end,
    so it ends exactly where the model first writes `end`. Nothing precedes the document where
    the reply opens no block, so an unreasoned reply matches as it would without a parser. A tag
    that is a special token is that token (text never holds one), as vLLM's parsers read it."""
    try:
        inner = json.loads(text)
    except json.JSONDecodeError:
        inner = None
    if not isinstance(inner, dict) or not isinstance(inner.get("grammars"), list):
        inner = {"grammars": [{"name": "constraint", "lark_grammar": text}]}
    grammars = [dict(g) for g in inner["grammars"]]
    grammars[0]["name"] = name = grammars[0].get("name") or "constraint"
    opening = "" if start is None else _tag(start, specials)
    if end in specials:  # any text, then the end tag's token (which no text lexeme holds)
        block, body = "/(?s:.+)/", f"{opening} BLOCK? {_tag(end, specials)} {_GAP}"
    else:  # one lexeme, the opening too where it is text
        head = "" if start is None or start in specials else _regex_literal(start)
        block = f"/{head}(?s:.*){_regex_literal(end)}/ & ~/(?s:.*){_regex_literal(end)}(?s:.+)/"
        body = f"{'' if head else opening} BLOCK {_GAP}"
    rule = f"start: {body} @{name}" if start is None else f"start: ({body})? @{name}"
    lark = f"{rule}\nBLOCK: {block}\n"
    inner["grammars"] = [{"name": _REASONING_GRAMMAR, "lark_grammar": lark}, *grammars]
    return json.dumps(inner)


def _tag(tag: str, specials: dict[str, int]) -> str:
    """A reasoning tag in lark: its special token by id, or its text."""
    return f"<[{specials[tag]}]>" if tag in specials else f"/{_regex_literal(tag)}/"


def _regex_literal(text: str) -> str:
    """`text` matched literally in a llguidance regex: each character but ASCII letters and digits
    as `\\x{...}`, so neither regex syntax nor lark's `/` delimiter can occur in it."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)
