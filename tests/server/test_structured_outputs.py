"""Structured outputs through the server with the official openai client, on a random-weight model
(only constrained decoding can make its output parse): JSON schema, json_object, regex, choice,
grammar; streamed and not; several seeds; n > 1; invalid constraints are 400s."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.real_engine import openai_client

MODEL = "tiny-llama"
CHAT: Any = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "admin"],
    "additionalProperties": False,
}
SCHEMA_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


@pytest.fixture
async def client(tiny_model_dir: pathlib.Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(tiny_model_dir) as c:
        yield c


async def test_json_schema_chat_outputs_validate_for_several_seeds(client: openai.AsyncOpenAI) -> None:
    for seed in range(4):
        r = await client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=SCHEMA_FORMAT, max_tokens=96, seed=seed, n=2
        )
        assert len(r.choices) == 2
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


async def test_json_schema_streamed_joins_to_a_valid_document(client: openai.AsyncOpenAI) -> None:
    for seed in (5, 6):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format=SCHEMA_FORMAT,
            max_tokens=96,
            seed=seed,
            n=2,
            stream=True,
        )
        texts: dict[int, str] = {0: "", 1: ""}
        async for chunk in stream:
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        for text in texts.values():
            jsonschema.validate(json.loads(text), PERSON)


async def test_json_object_and_greedy_json_parse(client: openai.AsyncOpenAI) -> None:
    for temperature in (0.0, 1.0):
        r = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format={"type": "json_object"},
            max_tokens=200,
            temperature=temperature,
            seed=1,
        )
        content = r.choices[0].message.content or ""
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
        else:  # an object may be long; what there is must still be a prefix of one
            assert content.startswith("{")


async def test_regex_and_choice_hold_on_chat_and_completions(client: openai.AsyncOpenAI) -> None:
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["yes", "no", "maybe later"]
    for seed in range(3):
        c = await client.completions.create(
            model=MODEL,
            prompt="Code:",
            max_tokens=20,
            seed=seed,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        assert re.fullmatch(regex, c.choices[0].text), c.choices[0].text
        r = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=20,
            seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert r.choices[0].message.content in choices
        stream = await client.completions.create(
            model=MODEL,
            prompt="Pick:",
            max_tokens=20,
            seed=seed,
            stream=True,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) in choices


async def test_grammar_and_json_on_completions(client: openai.AsyncOpenAI) -> None:
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
    c = await client.completions.create(
        model=MODEL,
        prompt="List:",
        max_tokens=40,
        seed=2,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    text = c.choices[0].text
    assert c.choices[0].finish_reason == "length" or re.fullmatch(r"\([a-c](,[a-c])*\)", text), text
    c = await client.completions.create(
        model=MODEL, prompt="{", max_tokens=96, seed=3, extra_body={"structured_outputs": {"json": PERSON}}
    )
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "nope",
        ),
        # A keyword the grammar cannot enforce is named (`uniqueItems: false`, the default, is dropped).
        (
            {
                "structured_outputs": {
                    "json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
                }
            },
            "uniqueItems",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "regex"),
        ({"structured_outputs": {"json": "{not json"}}, "not JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "grammar"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
    ],
)
async def test_invalid_constraints_are_400s_with_the_reason(
    client: openai.AsyncOpenAI, body: dict[str, Any], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body=body)
    assert info.value.status_code == 400
    assert needle in str(info.value.message)
