"""Structured outputs in the engine: masks in the sampler for every constrained row of a batch,
grammar state across preemption and prefix-cache hits, no drafts for constrained sequences, the
compiled-grammar cache, and the mask bits themselves."""

from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest
import torch
from corral_engine.errors import InvalidRequestError
from corral_engine.sampling_params import SamplingParams
from corral_engine.structured.masks import TokenMasks, apply_token_masks
from corral_engine.structured.spec import GrammarSpec

from tests.engine.helpers import make_engine, run_checked

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "word": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "word", "ok"],
    "additionalProperties": False,
}
JSON = GrammarSpec.json_schema(SCHEMA, "test")


def _texts(engine, ids: list[str]) -> list[str]:  # type: ignore[no-untyped-def]
    tok = engine.tokenizer
    final = run_checked(engine)
    return [tok.decode(final[i], skip_special_tokens=True) for i in ids]


def test_mask_bits_allow_exactly_the_set_tokens() -> None:
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)  # 64 tokens' worth: tokens 64..69 never allowed
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 1] = -(2**31)  # bit 31 of word 1: token 63
    apply_token_masks(logits, TokenMasks(rows=[0, 2], bitmask=bitmask))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()  # an unconstrained row is untouched
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63]
    every = torch.zeros(2, 40)  # every row constrained (one op), a vocabulary narrower than the mask
    apply_token_masks(every, TokenMasks(rows=[0, 1], bitmask=bitmask))
    assert torch.isfinite(every[0]).nonzero().flatten().tolist() == [0, 2]
    assert not torch.isfinite(every[1]).any()  # token 63 is past this vocabulary


def test_mixed_batch_with_preemption_keeps_every_constrained_output_valid(
    tiny_model_dir: pathlib.Path,
) -> None:
    # 8 long sequences on 14 blocks of 16 tokens: the scheduler must preempt and recompute.
    engine = make_engine(tiny_model_dir, num_kv_blocks=14, block_size=16)
    ids = []
    for i in range(8):
        grammar = JSON if i % 2 == 0 else None
        params = SamplingParams(max_tokens=90, seed=i, grammar=grammar, ignore_eos=grammar is None)
        engine.add_request(f"r{i}", f"request number {i}", params)
        ids.append(f"r{i}")
    texts = _texts(engine, ids)
    assert engine.scheduler.num_preemptions > 0
    for i, text in enumerate(texts):
        if i % 2 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
    assert engine.grammars.num_compiled == 1  # four requests, one schema: compiled once


def test_prefix_cache_hits_and_n_siblings_each_follow_the_grammar(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, enable_prefix_caching=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    for i in range(3):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=80, n=3, seed=i, grammar=JSON))
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        for o in final[f"p{i}"].outputs:
            jsonschema.validate(json.loads(o.text), SCHEMA)
    assert engine.block_manager.num_prefix_hits > 0


def test_constrained_greedy_requests_never_speculate(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir, speculative="ngram", num_speculative_tokens=3)
    regex = GrammarSpec("regex", "(ab|cd){2,30}", param="test")
    engine.add_request(
        "g", "abababab cdcd abab", SamplingParams(max_tokens=40, temperature=0.0, grammar=regex)
    )
    (text,) = _texts(engine, ["g"])
    assert engine.stats().num_spec_proposed_total == 0
    assert len(text) >= 4 and set(text) <= set("abcd")


def test_invalid_grammars_are_refused_when_the_request_is_built(tiny_model_dir: pathlib.Path) -> None:
    engine = make_engine(tiny_model_dir)
    bad = GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "nope"}}}, "response_format"
    )
    with pytest.raises(InvalidRequestError, match="nope") as info:
        engine.add_request("x", "hi", SamplingParams(grammar=bad))
    assert info.value.param == "response_format"
    assert not engine.has_unfinished_requests()


def test_unique_items_false_constrains_nothing_and_true_is_refused_by_name(
    tiny_model_dir: pathlib.Path,
) -> None:
    """`uniqueItems: false` is JSON Schema's default: compiled as if absent (llguidance refuses the
    keyword at any value). `true` a grammar cannot enforce: a 400 naming it, as vLLM's guidance gives."""
    engine = make_engine(tiny_model_dir)
    tags = {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}

    def schema(unique: bool) -> dict[str, object]:
        listed = {**tags, "uniqueItems": unique}
        # In $defs, and beside a property that is *named* uniqueItems (data, not the keyword).
        return {
            "type": "object",
            "properties": {"tags": {"$ref": "#/$defs/tags"}, "uniqueItems": {"type": "boolean"}},
            "required": ["tags", "uniqueItems"],
            "additionalProperties": False,
            "$defs": {"tags": listed},
        }

    allowed = GrammarSpec.json_schema(schema(False), "response_format")
    engine.add_request("ok", "hi", SamplingParams(max_tokens=60, seed=0, grammar=allowed))
    (text,) = _texts(engine, ["ok"])
    jsonschema.validate(json.loads(text), schema(False))
    assert '"maxItems":3}' in allowed.text and '"uniqueItems":false' not in allowed.text
    # A property named uniqueItems whose schema is `false` (it must be absent) is no keyword: kept.
    named = {"type": "object", "properties": {"uniqueItems": False}}
    assert json.loads(GrammarSpec.json_schema(named, "x").text) == named
    refused = GrammarSpec.json_schema(schema(True), "response_format")
    with pytest.raises(InvalidRequestError, match="uniqueItems") as info:
        engine.add_request("no", "hi", SamplingParams(grammar=refused))
    assert info.value.param == "response_format"
    assert not engine.has_unfinished_requests()
