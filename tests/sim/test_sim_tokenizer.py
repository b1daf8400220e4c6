"""The simulated replicas' tokenizer (no transformers) renders chats and encodes as transformers does,
tools and chat_template_kwargs included, so a simulated replica answers chat requests like a real one."""

from __future__ import annotations

import pathlib

from corral_engine.sim.tokenizer import LightTokenizer
from transformers import AutoTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "cold"},
]


def test_chat_rendering_matches_transformers(tiny_model_dir: pathlib.Path) -> None:
    light, reference = LightTokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    for kwargs in ({}, {"tools": TOOLS}, {"tools": TOOLS, "enable_thinking": False}):
        want = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        got = light.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        assert got == want
    assert "get_weather" in light.apply_chat_template(MESSAGES, tools=TOOLS)
    assert light.encode("Weather in Oslo?") == reference.encode("Weather in Oslo?")


def test_decode_keeps_special_tokens_unless_told_as_transformers_does(tiny_model_dir: pathlib.Path) -> None:
    light, reference = LightTokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = light.encode("Weather in Oslo?")
    assert light.decode(ids[:1]) == reference.decode(ids[:1]) == "<s>"  # /tokenize's token_strs
    assert light.decode(ids) == reference.decode(ids)
    assert light.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
