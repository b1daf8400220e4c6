"""Incremental detokenization: no broken UTF-8, concatenation equals a full decode, stop strings."""

from __future__ import annotations

import pathlib
import random

import pytest
from corral_engine.tokenizer import IncrementalDetokenizer, encoder, load_tokenizer


def stream(
    tokenizer, prompt: list[int], output: list[int], stop=(), include=False
) -> tuple[list[str], str | None]:
    detok = IncrementalDetokenizer(tokenizer, prompt, tuple(stop), include)
    pieces: list[str] = []
    matched = None
    for i, tok in enumerate(output):
        matched = detok.add_token(tok)
        last = matched is not None or i == len(output) - 1
        if last and matched is None:
            detok.flush()
        pieces.append(detok.take_delta(finished=last))
        if matched is not None:
            break
    return pieces, matched


def test_random_tokens_concatenate_to_full_decode(tiny_model_dir: pathlib.Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(50):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        pieces, _ = stream(tokenizer, prompt, output)
        assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=True)


def test_multibyte_characters_are_never_split(tiny_model_dir: pathlib.Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "naïve café — 東京 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, _ = stream(tokenizer, [], ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_output_and_is_never_streamed(tiny_model_dir: pathlib.Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("the cat sat on the mat and slept", add_special_tokens=False)
    pieces, matched = stream(tokenizer, [], ids, stop=["on the"])
    assert matched == "on the"
    assert "".join(pieces) == "the cat sat "
    pieces, _ = stream(tokenizer, [], ids, stop=["on the"], include=True)
    assert "".join(pieces) == "the cat sat on the"


def test_fast_tokenizers_decode_in_rust_unless_spaces_are_cleaned_up(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("hello , world . naïve", add_special_tokens=False)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    original = tokenizer.decode
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> str:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counted)
    assert "".join(stream(tokenizer, [1, 2], ids)[0]) == expected
    assert calls == []  # straight to the Rust tokenizer
    # With clean-up on, transformers post-processes decoded text: keep going through it.
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    stream(tokenizer, [1, 2], ids)
    assert calls


def test_fast_tokenizers_encode_in_rust_exactly_as_transformers_does(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    special = [t for t in tokenizer.all_special_tokens if t][:3]
    texts = ["", " ", "hello , world . naïve", "\n\tmixed  spaces\n", "日本語 🦙 ok", *special]
    texts += [f"{special[0]}inside{special[-1]} text"] if special else []
    expected = [list(tokenizer.encode(t)) for t in texts]
    original = tokenizer.encode
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> list[int]:
        calls.append(1)
        return list(original(*args, **kwargs))

    monkeypatch.setattr(tokenizer, "encode", counted)
    assert [encoder(tokenizer)(t) for t in texts] == expected
    assert calls == []  # straight to the Rust tokenizer
    # Truncation set on the Rust tokenizer (transformers resets it per call): go through transformers.
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    assert encoder(tokenizer)(texts[2]) == expected[2] and calls
