"""Structured outputs on a simulated replica: a constraint is compiled by the engine's own grammar
compiler, so one the engine refuses is the same 400 here, and a constrained output (regex, choice,
grammar, JSON schema, json_object, tool_choice required or named) matches its constraint."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
from corral_engine.errors import InvalidRequestError
from corral_engine.server import create_app
from corral_engine.server.api_structured import StructuredOutputs
from corral_engine.sim.host import ReplicaSpec, build_engines, eos_token_ids
from corral_engine.sim.perf_model import BUILTIN
from corral_engine.sim.tokenizer import LightTokenizer
from corral_engine.structured.compiler import GrammarCompiler

from tests.server.test_structured_outputs import CHAT, PERSON

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture
async def client(tiny_model_dir: pathlib.Path) -> AsyncIterator[httpx.AsyncClient]:
    spec = ReplicaSpec(BUILTIN["h100-llama3-8b"], tiny_model_dir, "sim")
    [engine] = build_engines(spec, 1)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            yield c


async def _chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/chat/completions", json={"model": "sim", "messages": CHAT, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize(
    "structured",
    [
        {"regex": "[0-9"},
        {"json": {"type": "nope"}},
        {"json": {"type": "string", "pattern": "(unclosed"}},
        {"grammar": "start: undefined_rule"},
    ],
    ids=["regex", "schema type", "schema pattern", "grammar"],
)
async def test_a_constraint_the_engine_refuses_is_the_engines_400(
    client: httpx.AsyncClient, tiny_model_dir: pathlib.Path, structured: dict[str, Any]
) -> None:
    tokenizer = LightTokenizer(tiny_model_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, eos_token_ids(tiny_model_dir, tokenizer))
    spec = StructuredOutputs.model_validate(structured).spec()
    with pytest.raises(InvalidRequestError) as engine_error:
        compiler.matcher(spec)  # what the engine runs on the request (engine_core._check)
    body = {"model": "sim", "messages": CHAT, "max_tokens": 8, "structured_outputs": structured}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["message"], error["param"]) == (str(engine_error.value), engine_error.value.param)


async def test_outputs_match_a_regex_a_choice_and_a_grammar(client: httpx.AsyncClient) -> None:
    for seed in range(3):
        r = await _chat(client, max_tokens=20, seed=seed, n=2, structured_outputs={"regex": "[0-9]{3}"})
        for choice in r["choices"]:
            assert re.fullmatch("[0-9]{3}", choice["message"]["content"]), choice
            assert choice["finish_reason"] == "stop"
        r = await _chat(client, max_tokens=20, seed=seed, structured_outputs={"choice": ["yes", "no"]})
        assert r["choices"][0]["message"]["content"] in ("yes", "no")
        grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
        body = {"model": "sim", "prompt": "List:", "max_tokens": 40, "seed": seed}
        c = await client.post("/v1/completions", json={**body, "structured_outputs": {"grammar": grammar}})
        assert re.fullmatch(r"\([a-c](,[a-c])*\)", c.json()["choices"][0]["text"]), c.json()


async def test_json_outputs_parse_and_validate(client: httpx.AsyncClient) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(4):
        r = await _chat(client, max_tokens=200, seed=seed, n=2, response_format=schema_format)
        for choice in r["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        r = await _chat(client, max_tokens=400, seed=seed, response_format={"type": "json_object"})
        assert r["choices"][0]["finish_reason"] == "stop", r
        assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    body = {"model": "sim", "messages": CHAT, "max_tokens": 200, "seed": 7, "stream": True}
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "response_format": schema_format}
    ) as stream:
        events = [line[6:] async for line in stream.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
    jsonschema.validate(json.loads("".join(chunks)), PERSON)


async def test_tool_choice_required_and_named_make_tool_calls(client: httpx.AsyncClient) -> None:
    for seed in range(3):
        r = await _chat(client, max_tokens=300, seed=seed, tools=[WEATHER, TIME], tool_choice="required")
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] in ("get_weather", "get_time")
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = await _chat(client, max_tokens=300, seed=seed, tools=[WEATHER, TIME], tool_choice=named)
        [call] = r["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


def test_replicas_share_one_grammar_compiler(tiny_model_dir: pathlib.Path) -> None:
    """The vocabulary llguidance builds (seconds for 128k tokens) and each grammar, once a process."""
    engines = build_engines(ReplicaSpec(BUILTIN["h100-llama3-8b"], tiny_model_dir, "sim"), 3)
    assert len({id(e.engine.grammars) for e in engines}) == 1
