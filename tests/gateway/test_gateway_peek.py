"""What the gateway reads from request bodies, and settings parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from corral_gateway.peek import IMAGE_TOKENS, block_hash_chain, block_prefix_hash, peek_request
from corral_gateway.settings import load_settings, parse_backend_flag
from pydantic import ValidationError


def test_completion_and_chat_fields() -> None:
    info = peek_request(
        json.dumps({"model": "m", "prompt": "hello", "stream": True, "max_tokens": 10}).encode()
    )
    assert info.model == "m" and info.is_stream and info.prefix_hash is not None
    assert info.estimated_tokens == 12  # 5 characters ~ 1 prompt token + 1, plus max_tokens
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    info = peek_request(json.dumps(chat).encode())
    assert info.model == "m" and not info.is_stream and info.prefix_hash is not None


@pytest.mark.parametrize("raw", [b"{not json", b"[1,2]", b'{"model": 5}', b"\xff\xfe", b"[" * 100000])
def test_unreadable_bodies_never_raise(raw: bytes) -> None:
    info = peek_request(raw)
    assert info.model is None and info.prefix_hash is None


def test_shared_head_shares_hash_and_different_heads_differ() -> None:
    system = "You are a helpful assistant. " * 20  # longer than the 4 x 64 character window
    a = peek_request(json.dumps({"model": "m", "prompt": system + "question one"}).encode())
    b = peek_request(json.dumps({"model": "m", "prompt": system + "another question"}).encode())
    c = peek_request(json.dumps({"model": "m", "prompt": "Something else entirely. " * 20}).encode())
    assert a.prefix_hash == b.prefix_hash != c.prefix_hash
    assert block_prefix_hash("short", 64, 4) != block_prefix_hash("shorter", 64, 4)


@pytest.mark.parametrize("alphabet", ["ab", "aé", "a\u4e2d\U0001f600"], ids=["ascii", "latin", "wide"])
def test_chains_share_the_first_k_hashes_exactly_when_prompts_share_the_first_k_blocks(alphabet: str) -> None:
    import random

    rng = random.Random(0)
    block = 8
    for _ in range(300):
        # Prompts over a two- or three-letter alphabet often share a few blocks, then differ.
        one = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12 * block)))
        keep = rng.randrange(0, len(one) + 1)
        two = one[:keep] + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 6 * block)))
        h1, h2 = block_hash_chain(one, block, 10), block_hash_chain(two, block, 10)
        assert len(h1) == min(10, len(one) // block)
        for k in range(min(len(h1), len(h2))):
            same_blocks = one[: (k + 1) * block] == two[: (k + 1) * block]
            assert (h1[k] == h2[k]) == same_blocks, (one, two, k)


def test_chain_hashes_do_not_depend_on_what_follows_and_mix_ascii_with_other_text() -> None:
    ascii_head = "x" * 64 * 3
    # Block k's hash depends only on blocks 0..k: the ASCII path (one encode) and the per-block
    # path (any non-ASCII character anywhere in the window) agree on the blocks both have.
    assert block_hash_chain(ascii_head, 64, 256) == block_hash_chain(ascii_head + "é" * 64, 64, 256)[:3]
    assert block_hash_chain(ascii_head + "é" * 70, 64, 2) == block_hash_chain(ascii_head, 64, 2)
    assert block_hash_chain("short", 64, 256) == ()
    # 64-bit values, fixed across processes (no PYTHONHASHSEED): pinned, so a change is deliberate.
    assert block_hash_chain("a" * 4, 4, 1) == ((0xAD98E545 << 32) | 0x03CE0185,)


def test_token_id_prompts_hash() -> None:
    info = peek_request(json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode())
    batch = peek_request(json.dumps({"model": "m", "prompt": [[1, 2, 3], [4]]}).encode())
    assert info.prefix_hash is not None and info.prefix_hash == batch.prefix_hash


def test_settings_merge_file_flags_and_validation(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text("backends:\n  m: [http://127.0.0.1:8101/]\npolicy: kv-aware\nmax_queue_len: 7\n")
    settings = load_settings(
        config, {"policy": None, "port": 9000}, ["m=http://127.0.0.1:8102", "x=http://h:1"]
    )
    assert settings.backends == {"m": ["http://127.0.0.1:8101", "http://127.0.0.1:8102"], "x": ["http://h:1"]}
    assert (settings.policy, settings.port, settings.max_queue_len) == ("kv-aware", 9000, 7)
    with pytest.raises(ValueError):
        parse_backend_flag("no-equals")
    with pytest.raises(ValidationError):
        load_settings(None, {"policy": "random"})
    with pytest.raises(ValidationError):
        load_settings(None, {}, ["m=ftp://x"])


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_GATEWAY_BACKENDS", '{"m": ["http://127.0.0.1:9001"]}')
    monkeypatch.setenv("CORRAL_GATEWAY_KUBERNETES__ENABLED", "true")
    monkeypatch.setenv("CORRAL_GATEWAY_POLICY", "least-requests")
    settings = load_settings(None, {"port": 9000})
    assert settings.backends == {"m": ["http://127.0.0.1:9001"]}
    assert settings.kubernetes.enabled and settings.policy == "least-requests" and settings.port == 9000


@pytest.mark.parametrize(
    ("body", "at_least"),
    [
        ({"prompt": "word " * 8000, "max_tokens": 1}, 8000),  # 40,000 characters
        ({"messages": [{"role": "user", "content": "word " * 8000}], "max_tokens": 1}, 8000),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "word " * 8000}]}]}, 8000),
        ({"prompt": list(range(10000)), "max_tokens": 1}, 10000),  # token ids
        ({"prompt": ["a long prompt " * 100] * 50, "max_tokens": 100}, 50 * (350 + 100)),  # a batch
        ({"input": "word " * 8000}, 8000),  # embeddings
        # Each message shorter than a token's ~4 characters: counted as text, not rounded away.
        ({"messages": [{"role": "user", "content": "hi!"}] * 8000, "max_tokens": 1}, 6000),
    ],
    ids=["prompt", "chat", "chat-parts", "token-ids", "batch", "embeddings", "short-messages"],
)
def test_token_estimate_counts_the_whole_prompt_and_every_prompt_of_a_batch(
    body: dict[str, object], at_least: int
) -> None:
    """A token-limited key is charged the estimate up front, and a stream without include_usage
    never reports the real count: an estimate from the routing prefix alone (~65 tokens) let one
    key spend many times its tokens_per_minute."""
    info = peek_request(json.dumps({"model": "m", **body}).encode())
    assert at_least <= info.estimated_tokens <= 2 * at_least + 100


def test_token_estimate_of_a_deeply_nested_body_does_not_raise() -> None:
    nested: object = "x"
    for _ in range(500):
        nested = [nested]
    info = peek_request(json.dumps({"model": "m", "prompt": nested}).encode())
    assert info.model == "m" and info.estimated_tokens >= 1


def test_a_responses_body_is_routed_and_charged_by_its_instructions_and_input() -> None:
    """The Responses API's `input` (text, or message and function-call items) and `instructions`
    make the routing prefix and the estimate, and `max_output_tokens` bounds the output."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "word " * 400}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"q": "' + "x" * 400 + '"}'},
        {"type": "function_call_output", "call_id": "c", "output": "y" * 400},
    ]
    body = {"model": "m", "instructions": "i" * 800, "input": items, "max_output_tokens": 1000}
    info = peek_request(json.dumps(body).encode())
    assert info.model == "m" and info.prefix_hash is not None
    assert 500 + 200 + 1000 <= info.estimated_tokens <= 2 * (500 + 200 + 1000)
    same_head = peek_request(json.dumps({**body, "input": "other"}).encode())
    assert same_head.prefix_hash == info.prefix_hash  # the instructions fill the routing window
    text = peek_request(json.dumps({"model": "m", "input": "hello " * 100}).encode())
    assert text.prefix_hash is not None


def test_an_embeddings_body_is_charged_its_inputs_only() -> None:
    """/v1/embeddings generates nothing: no default max_tokens per input is charged (a batch of 64
    short texts was charged 64 x 16 output tokens on top of its ~80 prompt tokens)."""
    texts = ["a short sentence to embed"] * 64  # 25 characters: ~6 tokens each
    body = json.dumps({"model": "m", "input": texts}).encode()
    info = peek_request(body, path="/v1/embeddings")
    assert 64 * 6 <= info.estimated_tokens <= 64 * 7
    ids = json.dumps({"model": "m", "input": [[1, 2, 3], [4, 5]]}).encode()
    assert peek_request(ids, path="/v1/embeddings").estimated_tokens == 5
    one = json.dumps({"model": "m", "input": "hi"}).encode()
    assert peek_request(one, path="/v1/embeddings").estimated_tokens == 1
    assert peek_request(body).estimated_tokens > 64 * 16  # elsewhere `input` may generate


def test_an_embeddings_batch_routes_by_its_first_input_as_a_completions_prompt() -> None:
    """Prefix affinity for /v1/embeddings reads `input` as the engine does (raw text, no chat
    template): a batch, text or token ids, hashes as a completions prompt of its first item."""
    doc = "shared document head " * 20

    def peek(given: object, path: str = "/v1/embeddings") -> object:
        return peek_request(json.dumps({"model": "m", "input": given}).encode(), 64, 4, 8, path=path)

    batch, single = peek([doc + "one", "other text"]), peek(doc + "two")
    assert batch.prefix_hash is not None and batch.prefix_hash == single.prefix_hash  # type: ignore[attr-defined]
    completion = peek_request(json.dumps({"model": "m", "prompt": doc}).encode(), 64, 4, 8)
    assert single.block_hashes == completion.block_hashes != ()  # type: ignore[attr-defined]
    ids = peek([list(range(300)), [1, 2]])
    assert ids.prefix_hash is not None and ids.block_hashes  # type: ignore[attr-defined]
    assert peek([doc, doc], path="/v1/responses").prefix_hash is None  # type: ignore[attr-defined]


def test_a_score_or_rerank_body_is_charged_both_texts_of_every_pair() -> None:
    """A rerank of 10 documents of ~40 tokens by a ~10-token query scores 10 pairs of ~50 tokens;
    was: 17 tokens whatever the body (no prompt found, plus the default max_tokens)."""
    query, document = "q" * 40, "d" * 160
    rerank = json.dumps({"model": "r", "query": query, "documents": [document] * 10}).encode()
    info = peek_request(rerank, path="/v1/rerank")
    assert info.model == "r" and info.prefix_hash is None
    assert info.estimated_tokens == 10 * (10 + 40)
    one_to_many = json.dumps({"model": "r", "text_1": query, "text_2": [document] * 4}).encode()
    assert peek_request(one_to_many, path="/v1/score").estimated_tokens == 4 * (10 + 40)
    pairs = json.dumps({"model": "r", "text_1": [query] * 3, "text_2": [document] * 3}).encode()
    assert peek_request(pairs, path="/score").estimated_tokens == 3 * (10 + 40)
    assert peek_request(b'{"model": "r"}', path="/v2/rerank").estimated_tokens == 1


def _image_chat(url: str, text: str = "What is in the picture?", max_tokens: int = 10) -> bytes:
    content = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "Answer in one short sentence, please."},
    ]
    return json.dumps(
        {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    ).encode()


def test_an_image_part_is_charged_as_an_image_not_its_url() -> None:
    """A 1 MB data: URL is one image's tokens (IMAGE_TOKENS), as a short http URL is; the text
    beside it is charged as text (the chat's and the Responses API's parts)."""
    big = "data:image/png;base64," + "A" * 1_000_000
    body = json.loads(_image_chat(big))
    del body["messages"][0]["content"][1]  # the same text, no image
    text_only = peek_request(json.dumps(body).encode()).estimated_tokens
    for url in (big, "http://127.0.0.1/cat.png"):
        assert peek_request(_image_chat(url)).estimated_tokens == text_only + IMAGE_TOKENS
    responses = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": big}],
            }
        ],
    }
    assert IMAGE_TOKENS < peek_request(json.dumps(responses).encode()).estimated_tokens < IMAGE_TOKENS + 40


def test_the_same_text_with_other_images_is_another_prefix() -> None:
    """The engine's prefix cache keys blocks by image content: two images part the prefix where
    the image is; the same image keeps it."""
    a, b = "data:image/png;base64,iVBORw0KGgoAAAA", "data:image/png;base64,iVBORw0KGgoBBBB"
    first, other, again = (peek_request(_image_chat(u), chain_blocks=8) for u in (a, b, a))
    assert first.prefix_hash == again.prefix_hash and first.block_hashes == again.block_hashes
    assert first.prefix_hash != other.prefix_hash
    # The text before the image is shared: the first block agrees, later ones part.
    long_text = "The quick brown fox jumps over the lazy dog. " * 2  # the first 64-char block
    first, other = (peek_request(_image_chat(u, long_text), chain_blocks=8) for u in (a, b))
    assert first.block_hashes[0] == other.block_hashes[0] and first.block_hashes != other.block_hashes
