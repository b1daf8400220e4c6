"""Benchmark workloads: random token-id prompts of exact lengths, ShareGPT JSON, and JSONL datasets.

Sampling is pure and seeded; reading files and loading a tokenizer are the only I/O here.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

# ShareGPT filters (as commonly used for serving benchmarks): drop trivial turns and overly long ones.
MIN_SHAREGPT_LEN = 4
# Without a tokenizer, dataset text lengths are estimated at this many UTF-8 bytes per token.
BYTES_PER_TOKEN_ESTIMATE = 4.0
# Without a tokenizer, random token ids are drawn below this bound: every byte-level vocabulary
# has at least 256 byte tokens plus a few specials, so these ids exist in any such model.
DEFAULT_RANDOM_VOCAB = 256
_NUM_LOW_IDS_SKIPPED = 3  # ids 0..2 are often pad/bos/eos-like specials
# Without a tokenizer, chat prompts are these letters, space-separated: a space and a common word's
# first letter make one token in any byte-level or SentencePiece vocabulary, small or large (the
# pre-tokenizer splits at spaces and these pairs are among the first merges). Whole words are not
# (" bravo" is one token in Llama-3's vocabulary, three in the 1,024-entry demo one). Letters that
# begin few words (e, q, u, x, ...) are left out: small vocabularies may not have merged them.
_TEXT_TOKENS = tuple("abcdfghilmnoprst")


class BenchTokenizer(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: a text or token-id prompt, its length in tokens, tokens to generate, and
    fields of its own merged into the request body (a JSONL record's `extra_body`, e.g. a
    `response_format` for some requests of a workload), and images to send with a chat prompt."""

    prompt: str | list[int]
    prompt_len: int  # the text's tokens; images add their own (the server's usage counts them)
    output_len: int
    extra_body: dict[str, Any] | None = None
    image_urls: tuple[str, ...] = ()  # chat only: image parts after the text (bench/images.py)


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` library (no transformers import)."""

    def __init__(self, path: str | pathlib.Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ModuleNotFoundError as e:
            raise ValueError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from e
        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.special_ids = frozenset(
            int(i) for i, t in self._tok.get_added_tokens_decoder().items() if getattr(t, "special", True)
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def count_tokens(text: str, tokenizer: BenchTokenizer | None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text))
    return max(1, round(len(text.encode("utf-8")) / BYTES_PER_TOKEN_ESTIMATE))


def length_range(mean_len: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] around mean_len: range_ratio 0 is exact, 0.5 is +-50%."""
    if mean_len < 1:
        raise ValueError(f"length must be >= 1, got {mean_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1.0 + range_ratio)))
    return low, high


def allowed_token_ids(tokenizer: BenchTokenizer | None, vocab_size: int | None) -> np.ndarray:
    """Ids random prompts may use: the vocabulary minus special tokens."""
    if tokenizer is not None:
        ids = np.arange(tokenizer.vocab_size)
        return ids[~np.isin(ids, list(tokenizer.special_ids))] if tokenizer.special_ids else ids
    upper = vocab_size if vocab_size is not None else DEFAULT_RANDOM_VOCAB + _NUM_LOW_IDS_SKIPPED
    if upper <= _NUM_LOW_IDS_SKIPPED:
        raise ValueError(f"vocabulary size must be > {_NUM_LOW_IDS_SKIPPED}, got {upper}")
    return np.arange(_NUM_LOW_IDS_SKIPPED, upper)


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """How random input/output lengths are drawn.

    uniform: within +-range_ratio of the given lengths. lognormal: median = the given lengths, spread
    `sigma` (of the log), clipped to [min_len, max_*_len] (a ShareGPT-like long tail).
    """

    input_len: int
    output_len: int
    range_ratio: float = 0.0
    dist: str = "uniform"  # "uniform" | "lognormal"
    sigma: float = 1.0
    min_len: int = 1
    max_input_len: int | None = None
    max_output_len: int | None = None


def sample_lengths(spec: LengthSpec, num_prompts: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (input lengths, output lengths) for `num_prompts` requests."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    if spec.dist == "uniform":
        in_low, in_high = length_range(spec.input_len, spec.range_ratio)
        out_low, out_high = length_range(spec.output_len, spec.range_ratio)
        in_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
        out_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
        return in_lens.tolist(), out_lens.tolist()
    if spec.dist != "lognormal":
        raise ValueError(f"unknown length distribution {spec.dist!r}; use uniform or lognormal")
    if spec.sigma <= 0 or spec.min_len < 1 or spec.input_len < 1 or spec.output_len < 1:
        raise ValueError("lognormal lengths need sigma > 0 and lengths >= 1")
    lens = []
    for median, upper in ((spec.input_len, spec.max_input_len), (spec.output_len, spec.max_output_len)):
        if upper is not None and upper < spec.min_len:
            raise ValueError(f"maximum length {upper} is below the minimum {spec.min_len}")
        drawn = np.rint(rng.lognormal(np.log(median), spec.sigma, size=num_prompts))
        lens.append(np.clip(drawn, spec.min_len, upper if upper is not None else None).astype(int).tolist())
    return lens[0], lens[1]


def sample_random(
    num_prompts: int,
    spec: LengthSpec,
    seed: int,
    token_ids: np.ndarray,
    as_text: BenchTokenizer | None = None,
    variant: int = 0,
) -> list[BenchRequest]:
    """Random prompts of exact token lengths (token-id prompts), or decoded text when `as_text` is given.

    Lengths depend on `seed` only; content also on `variant`, so each run of a sweep can get the same
    lengths with fresh prompts (no prefix-cache hits on an earlier run's prompts).
    """
    in_lens, out_lens = sample_lengths(spec, num_prompts, seed)
    content_rng = np.random.default_rng([seed, variant])
    requests = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        ids = content_rng.choice(token_ids, size=in_len).tolist()
        if as_text is not None:
            text = as_text.decode(ids)
            requests.append(BenchRequest(text, len(as_text.encode(text)), out_len))
        else:
            requests.append(BenchRequest(ids, in_len, out_len))
    return requests


def random_text_prompts(
    num_prompts: int, spec: LengthSpec, seed: int, variant: int = 0
) -> list[BenchRequest]:
    """Text prompts of the drawn lengths, one token a letter (_TEXT_TOKENS), when no tokenizer is at
    hand (chat endpoints). The chat template's own tokens come on top, as with --tokenizer."""
    in_lens, out_lens = sample_lengths(spec, num_prompts, seed)
    content_rng = np.random.default_rng([seed, variant])
    requests = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        letters = content_rng.integers(0, len(_TEXT_TOKENS), size=in_len)
        text = " ".join(_TEXT_TOKENS[int(i)] for i in letters)
        requests.append(BenchRequest(text, in_len, out_len))
    return requests


def parse_sharegpt(
    entries: list[Any], tokenizer: BenchTokenizer | None, max_prompt_len: int, max_total_len: int
) -> list[BenchRequest]:
    """Prompt = the first human turn, output length = tokens of the reply that follows it."""
    requests = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        prompt, completion = first.get("value"), reply.get("value")
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            continue
        prompt_len, output_len = count_tokens(prompt, tokenizer), count_tokens(completion, tokenizer)
        if prompt_len < MIN_SHAREGPT_LEN or output_len < MIN_SHAREGPT_LEN:
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        requests.append(BenchRequest(prompt, prompt_len, output_len))
    return requests


def parse_jsonl_record(record: Any, tokenizer: BenchTokenizer | None, line_no: int) -> BenchRequest:
    """{"prompt": "text" | [ids], "output_len": N[, "extra_body": {...}]} (also accepts
    prompt_token_ids / max_tokens)."""
    if not isinstance(record, dict):
        raise ValueError(f"line {line_no}: expected a JSON object")
    prompt = record.get("prompt", record.get("prompt_token_ids"))
    output_len = record.get("output_len", record.get("max_tokens"))
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and i >= 0 for i in prompt):
        prompt_len = len(prompt)
    elif isinstance(prompt, str) and prompt:
        prompt_len = count_tokens(prompt, tokenizer)
    else:
        raise ValueError(f"line {line_no}: 'prompt' must be non-empty text or a list of token ids")
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ValueError(f"line {line_no}: 'output_len' must be an integer >= 1")
    extra_body = record.get("extra_body")
    if extra_body is not None and not isinstance(extra_body, dict):
        raise ValueError(f"line {line_no}: 'extra_body' must be a JSON object")
    return BenchRequest(prompt, prompt_len, output_len, extra_body)


def load_dataset(
    path: str | pathlib.Path,
    num_prompts: int,
    seed: int,
    tokenizer: BenchTokenizer | None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """Read ShareGPT JSON (a list) or JSONL, then take a seeded sample of `num_prompts` requests."""
    file = pathlib.Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read dataset {path}: {e.strerror or e}") from e
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        requests = parse_sharegpt(entries, tokenizer, max_prompt_len, max_total_len)
    else:
        requests = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n} is not valid JSON: {e}") from e
            requests.append(parse_jsonl_record(record, tokenizer, n))
    if not requests:
        raise ValueError(f"{path} holds no usable requests")
    return sample_requests(requests, num_prompts, seed)


def as_chat_prompts(
    requests: list[BenchRequest], tokenizer: BenchTokenizer | None, endpoint_type: str = "chat"
) -> list[BenchRequest]:
    """Chat messages (and rerank queries and documents) carry text: token-id prompts are decoded
    with `tokenizer` (their length is the decoded text's); ValueError when there are some and no
    tokenizer."""
    if all(isinstance(r.prompt, str) for r in requests):
        return requests
    if tokenizer is None:
        instead = "embeddings" if endpoint_type == "rerank" else "completions"
        raise ValueError(
            f"the dataset has token-id prompts and --endpoint-type {endpoint_type} sends text: "
            f"give --tokenizer DIR to decode them, or use --endpoint-type {instead}"
        )
    chat = []
    for request in requests:
        if isinstance(request.prompt, list):
            text = tokenizer.decode(request.prompt)
            request = replace(request, prompt=text, prompt_len=len(tokenizer.encode(text)))
        chat.append(request)
    return chat


def sample_requests(requests: list[BenchRequest], num_prompts: int, seed: int) -> list[BenchRequest]:
    """A seeded sample without replacement; all of them (shuffled) when there are fewer."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    order = np.random.default_rng(seed).permutation(len(requests))
    if num_prompts > len(requests):
        log.warning("dataset has %d usable requests; using all of them", len(requests))
    return [requests[int(i)] for i in order[:num_prompts]]
