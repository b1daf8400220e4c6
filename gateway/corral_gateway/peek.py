"""Peek at an OpenAI request body: the model, stream flag, prompt prefix and a token estimate.

The gateway routes on these and forwards the original bytes; the engine validates everything else,
so a body the gateway cannot read is still forwarded and gets the engine's own error.
"""

from __future__ import annotations

import email.parser
import email.policy
import hashlib
import json
import math
import zlib
from dataclasses import dataclass, replace
from typing import Any

# Rough characters per token, for token rate limits charged before the real usage is known.
_CHARS_PER_TOKEN = 4
_DEFAULT_MAX_TOKENS = 16
_MAX_PROMPT_DEPTH = 4
_TEXT_FIELDS = ("content", "text", "arguments", "output")
# An image content part (chat's image_url, the Responses API's input_image) is charged this many
# tokens, not its URL's length (a 1 MB data: URL is not 250k tokens): LLaVA-1.5's 24x24 patches,
# the most common vision tower's; the engine's usage settles the real count.
IMAGE_TOKENS = 576
_IMAGE_PART_TYPES = ("image_url", "input_image")
# Routes whose `input` is raw text or token ids, pooled into vectors: nothing is generated, and
# the engine reads the text as a completions prompt (no chat template).
POOLING_PATHS = frozenset({"/v1/embeddings", "/pooling"})
# vLLM's cross-encoder routes: pairs of texts scored, nothing generated.
SCORING_PATHS = frozenset({"/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"})


@dataclass(frozen=True, slots=True)
class RequestInfo:
    model: str | None  # None when the body is not a JSON object with a string `model`
    is_stream: bool
    prefix_hash: int | None  # hash of the prompt's leading blocks, None when there is no prompt text
    estimated_tokens: int
    block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks (when asked)


def prompt_prefix(body: dict[str, Any], max_chars: int, is_pooling: bool = False) -> str | None:
    """The first `max_chars` characters of the prompt (completions), of the rendered messages
    (chat), of the instructions and input items (responses), or of the input (`is_pooling`: an
    embeddings body, read as a completions prompt: a batch by its first input)."""
    if is_pooling:
        return _prompt_prefix(body.get("input"), max_chars)
    if "messages" in body:
        return _messages_prefix(body["messages"], max_chars)
    if "input" in body and "prompt" not in body:
        return _messages_prefix(_response_messages(body), max_chars)
    return _prompt_prefix(body.get("prompt"), max_chars)


def _prompt_prefix(prompt: Any, max_chars: int) -> str | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch routes by its first prompt
    if isinstance(prompt, str):
        return prompt[:max_chars] if prompt else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:max_chars]):
        # Token ids: ~4 characters a token, so the window covers about as much text.
        return " ".join(str(t) for t in prompt[: max(1, max_chars // _CHARS_PER_TOKEN)])
    return None


def _messages_prefix(messages: Any, max_chars: int) -> str | None:
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    num_chars = 0
    for message in messages:
        if num_chars >= max_chars or not isinstance(message, dict):
            break
        text = _content_text(message.get("content"))
        piece = f"<{message.get('role')}>{text}"
        parts.append(piece)
        num_chars += len(piece)
    joined = "".join(parts)[:max_chars]
    return joined or None


def _response_messages(body: dict[str, Any]) -> list[Any]:
    """A Responses API body's `instructions` and `input` as chat-like messages: a string input is
    the user's; an item without content (a function call, its output) shows its arguments or
    output. Other inputs (an embeddings batch) are not messages."""
    head = (
        [{"role": "system", "content": body["instructions"]}]
        if isinstance(body.get("instructions"), str)
        else []
    )
    items = body["input"]
    if isinstance(items, str):
        return [*head, {"role": "user", "content": items}]
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return []
    return head + [
        {"role": item.get("role", item.get("type")), "content": _item_content(item)} for item in items
    ]


def _item_content(item: dict[str, Any]) -> Any:
    for name in ("content", "output", "arguments"):
        if name in item:
            return item[name]
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content if isinstance(p, dict))
    return ""


def _part_text(part: dict[str, Any]) -> str:
    """A part's text; an image part's is a mark naming its URL's bytes, so requests of the same text
    but other images part where the engine's prefix cache does (it keys blocks by image content)."""
    if part.get("type") not in _IMAGE_PART_TYPES:
        return str(part.get("text", ""))
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        return "<image>"
    # CRC-32 runs at GB/s in C: a 1 MB data: URL costs under a millisecond.
    return f"<image {zlib.crc32(url.encode('utf-8', 'replace')):08x}>"


def block_prefix_hash(prefix: str, block_chars: int, num_blocks: int) -> int:
    """64-bit hash of the prompt's leading blocks; stable across processes (no PYTHONHASHSEED)."""
    num_full = min(num_blocks, len(prefix) // block_chars)
    # Whole blocks only, so prompts sharing a long head agree; short prompts hash entirely.
    window = prefix[: num_full * block_chars] if num_full else prefix
    return int.from_bytes(hashlib.blake2b(window.encode("utf-8", "replace"), digest_size=8).digest(), "big")


def block_hash_chain(prefix: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Hashes of the prompt's full blocks, each over every block before it, so two prompts share
    the first k hashes exactly when they share the first k blocks (the llm-d scorer's index).

    Hash k is the CRC-32 (high 32 bits) and the Adler-32 (low 32 bits) of the UTF-8 bytes of blocks
    0..k, both carried from block to block: two C calls a block, where a blake2b of the parent and
    the block cost a Python-level hash object each (0.24 ms for 256 blocks, 2.5x this; routing
    needs no cryptographic strength). Stable across processes, like `block_prefix_hash`."""
    num_blocks = min(max_blocks, len(prefix) // block_chars)
    if prefix.isascii():  # one encode, sliced; other text is encoded a block at a time
        raw = prefix[: num_blocks * block_chars].encode("ascii")
        blocks = [raw[i : i + block_chars] for i in range(0, len(raw), block_chars)]
    else:
        blocks = [
            prefix[i * block_chars : (i + 1) * block_chars].encode("utf-8", "replace")
            for i in range(num_blocks)
        ]
    out: list[int] = []
    crc, adler = 0, 1
    for block in blocks:
        crc, adler = zlib.crc32(block, crc), zlib.adler32(block, adler)
        out.append(crc << 32 | adler)
    return tuple(out)


def _pair_tokens(body: dict[str, Any]) -> int:
    """A score or rerank body's tokens: each pair holds both of its texts, so the one query (or the
    one first text of a 1:N score) counts once per document."""
    first = body.get("query", body.get("text_1"))
    second = body.get("documents", body.get("text_2"))
    num_second = len(second) if isinstance(second, list) else 1
    num_first = num_second if not isinstance(first, list) else 1
    return max(1, math.ceil(num_first * _num_tokens(first) + _num_tokens(second)))


def _estimate_tokens(body: dict[str, Any], is_pooling: bool = False) -> int:
    """The request's prompt tokens (from all of its text, not the routing prefix) plus the most it
    may generate: what a token-limited key is charged up front. A stream without `include_usage`
    reports no usage to settle from, so this is all it is ever charged. A pooling request
    (`is_pooling`: embeddings) generates nothing: its inputs' tokens alone."""
    if is_pooling:
        return max(1, math.ceil(_num_tokens(body.get("input"))))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = _DEFAULT_MAX_TOKENS
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 128 else 1
    prompt = body.get("messages", body.get("prompt", body.get("input")))
    # A completions batch (a list of texts or of token-id lists) answers each of its prompts.
    num_prompts = 1
    if isinstance(prompt, list) and "messages" not in body and all(isinstance(p, str | list) for p in prompt):
        num_prompts = max(1, len(prompt))
    num_prompt_tokens = int(_num_tokens(prompt) + _num_tokens(body.get("instructions")))
    return num_prompt_tokens + 1 + num_prompts * n * max_tokens


def _num_tokens(value: Any, depth: int = 0) -> float:
    """About how many tokens `value` holds: text at ~4 characters a token, token ids one each,
    lists and messages (their `content`, `text` parts) summed. Messages nest four deep (list,
    message, parts, part); anything deeper is not a prompt and is not walked."""
    if isinstance(value, str):
        # Not rounded here: 300k messages of "hi" are 150k tokens, not 300k times none.
        return len(value) / _CHARS_PER_TOKEN
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if depth >= _MAX_PROMPT_DEPTH:
        return 0
    if isinstance(value, list):
        return sum(_num_tokens(item, depth + 1) for item in value)
    if isinstance(value, dict):  # a message or part; a Responses function call or its output
        if value.get("type") in _IMAGE_PART_TYPES:
            return IMAGE_TOKENS
        return sum(_num_tokens(value[k], depth + 1) for k in _TEXT_FIELDS if k in value)
    return 0


def peek_request(
    raw: bytes,
    block_chars: int = 64,
    num_blocks: int = 4,
    chain_blocks: int = 0,
    content_type: str | None = None,
    path: str = "",
) -> RequestInfo:
    """Never raises: anything unreadable yields model=None and lets the engine answer. With
    `chain_blocks`, also the chained hashes of up to that many blocks (`block_hash_chain`).
    Multipart bodies (vLLM's /v1/audio/*) are read for their `model` field only. `path`: the
    route, which says how `input` reads (`POOLING_PATHS`)."""
    if content_type is not None and content_type.lower().startswith("multipart/form-data"):
        return RequestInfo(
            model=_form_model(raw, content_type), is_stream=False, prefix_hash=None, estimated_tokens=1
        )
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return RequestInfo(model=None, is_stream=False, prefix_hash=None, estimated_tokens=1)
    if not isinstance(body, dict):
        return RequestInfo(model=None, is_stream=False, prefix_hash=None, estimated_tokens=1)
    model = body.get("model")
    is_pooling = path in POOLING_PATHS
    if path in SCORING_PATHS:  # no prompt to route by, nothing generated
        return RequestInfo(
            model=model if isinstance(model, str) else None,
            is_stream=False,
            prefix_hash=None,
            estimated_tokens=_pair_tokens(body),
        )
    prefix = prompt_prefix(body, block_chars * num_blocks, is_pooling)
    chain: tuple[int, ...] = ()
    if chain_blocks:
        long_prefix = prompt_prefix(body, block_chars * chain_blocks, is_pooling)
        chain = block_hash_chain(long_prefix, block_chars, chain_blocks) if long_prefix else ()
    return RequestInfo(
        model=model if isinstance(model, str) else None,
        is_stream=body.get("stream") is True,
        prefix_hash=None if prefix is None else block_prefix_hash(prefix, block_chars, num_blocks),
        estimated_tokens=_estimate_tokens(body, is_pooling),
        block_hashes=chain,
    )


def for_adapter(info: RequestInfo, adapter: str) -> RequestInfo:
    """`info` for a request of LoRA adapter `adapter`: its prefix hashes mixed with the adapter's
    name, since an engine caches an adapter's KV apart from the base model's and other adapters'
    (the same prompt is another prefix there). Mixing every hash with one value keeps the chain's
    property: two prompts of the adapter share the first k hashes exactly when they share k blocks."""
    salt = int.from_bytes(hashlib.blake2b(adapter.encode("utf-8", "replace"), digest_size=8).digest(), "big")
    return replace(
        info,
        prefix_hash=None if info.prefix_hash is None else info.prefix_hash ^ salt,
        block_hashes=tuple(h ^ salt for h in info.block_hashes),
    )


def with_model(raw: bytes, model: str) -> bytes:
    """A JSON body with `model` replaced; any other body (a multipart form) is returned as it is."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    if not isinstance(body, dict):
        return raw
    body["model"] = model
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _form_model(raw: bytes, content_type: str) -> str | None:
    """The `model` field of a multipart/form-data body (the standard library's MIME parser)."""
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
    try:
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    except (ValueError, TypeError, IndexError):
        return None
    if not message.is_multipart():
        return None
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == "model":
            payload = part.get_payload(decode=True)
            if isinstance(payload, bytes):
                return payload.decode("utf-8", "replace").strip() or None
    return None
