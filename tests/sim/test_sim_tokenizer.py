"""The simulated replicas' tokenizer (no transformers) renders chats and encodes as transformers does,
tools and chat_template_kwargs included, so a simulated replica answers chat requests like a real one;
a corrupt checkpoint file ends `corral engine --simulate` with one error line, as a bad real model does."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil

import pytest
from corral_cli import cmd_engine
from corral_cli.simulate import run_simulated
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


NAMED_TEMPLATES = [
    {"name": "default", "template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"},
    {"name": "tool_use", "template": "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}"},
]


def _with_templates(model_dir: pathlib.Path, to: pathlib.Path, templates: object) -> pathlib.Path:
    """A copy of `model_dir`'s tokenizer whose tokenizer_config.json holds `templates`."""
    to.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(model_dir / name, to / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (to / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": templates}))
    return to


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_pairs_encode_and_truncate_as_transformers_does(
    demo_encoders: dict[str, pathlib.Path], arch: str
) -> None:
    """A simulated reranker's /v1/score pairs: the tokenizer's pair encoding, token types and
    longest-first truncation as transformers' (was: not callable, so /v1/score failed)."""
    model_dir = demo_encoders[f"{arch}-reranker"]
    light, reference = LightTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    long_text = " ".join(["berlin is well known for its museums"] * 3)
    for first, second in (
        ("what is the capital of france", "paris is the capital of france"),
        (long_text, "a"),
    ):
        for cut in ({}, {"truncation": True, "max_length": 12}, {"truncation": True, "max_length": 5}):
            got, want = light(first, second, **cut), reference(first, second, **cut)
            assert got["input_ids"] == want["input_ids"]
            assert got["token_type_ids"] == want.get("token_type_ids", [0] * len(want["input_ids"]))
    assert light.encode("paris") == reference("paris")["input_ids"]  # the shared tokenizer is not cut


def test_named_chat_templates_are_chosen_as_transformers_chooses(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """transformers' list form of `chat_template`: "default", or "tool_use" when tools are given,
    or one named in place of a template; a list with no default renders nothing."""
    named = _with_templates(tiny_model_dir, tmp_path / "named", NAMED_TEMPLATES)
    light, reference = LightTokenizer(named), AutoTokenizer.from_pretrained(named)
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "tool_use", "tools": TOOLS}):
        want = reference.apply_chat_template(MESSAGES[:2], tokenize=False, **kwargs)
        assert light.apply_chat_template(MESSAGES[:2], **kwargs) == want
    assert light.apply_chat_template(MESSAGES[:2]) == "<system>Be brief.<user>Weather in Oslo?"
    assert light.apply_chat_template(MESSAGES[:2], tools=TOOLS) == "[get_weather]"
    no_default = _with_templates(tiny_model_dir, tmp_path / "no-default", NAMED_TEMPLATES[1:])
    for tokenizer in (LightTokenizer(no_default), AutoTokenizer.from_pretrained(no_default)):
        with pytest.raises(ValueError, match="default"):
            tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False)


def _saved_by_transformers(model_dir: pathlib.Path, to: pathlib.Path, templates: object) -> pathlib.Path:
    """`model_dir`'s tokenizer with `templates`, written by transformers' own save_pretrained."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = templates
    tokenizer.save_pretrained(to)
    return to


def _assert_renders_as_transformers(model_dir: pathlib.Path, *calls: dict[str, object]) -> None:
    light, reference = LightTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for kwargs in calls:
        want = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        assert light.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs) == want


def test_templates_saved_as_jinja_files_render_as_transformers_renders_them(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """transformers >= 4.43 saves a template as chat_template.jinja, and named ones in
    additional_chat_templates/, leaving tokenizer_config.json without one: a modern checkpoint."""
    own = AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    one = _saved_by_transformers(tiny_model_dir, tmp_path / "one", own)
    assert (one / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((one / "tokenizer_config.json").read_text())
    _assert_renders_as_transformers(one, {}, {"tools": TOOLS, "enable_thinking": False})
    named = {t["name"]: t["template"] for t in NAMED_TEMPLATES} | {"brief": "{{ messages | length }}"}
    many = _saved_by_transformers(tiny_model_dir, tmp_path / "many", named)
    extra = sorted(p.name for p in (many / "additional_chat_templates").iterdir())
    assert extra == ["brief.jinja", "tool_use.jinja"] and (many / "chat_template.jinja").is_file()
    _assert_renders_as_transformers(many, {}, {"tools": TOOLS}, {"chat_template": "brief"})
    assert LightTokenizer(many).apply_chat_template(MESSAGES, chat_template="brief") == "4"


def test_template_files_take_precedence_over_tokenizer_config_as_in_transformers(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Any template file replaces tokenizer_config.json's entry whole; a folder template named
    "default" replaces chat_template.jinja; a folder without one leaves no default."""
    model_dir = _with_templates(tiny_model_dir, tmp_path / "model", "config:{{ messages | length }}")
    (model_dir / "chat_template.jinja").write_text("file:{{ messages[0]['content'] }}")
    _assert_renders_as_transformers(model_dir, {})
    assert LightTokenizer(model_dir).apply_chat_template(MESSAGES) == "file:Be brief."
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "default.jinja").write_text("folder:{{ messages[1]['role'] }}")
    _assert_renders_as_transformers(model_dir, {})
    assert LightTokenizer(model_dir).apply_chat_template(MESSAGES) == "folder:user"
    (model_dir / "chat_template.jinja").unlink()
    (model_dir / "additional_chat_templates" / "default.jinja").rename(
        model_dir / "additional_chat_templates" / "tool_use.jinja"
    )
    _assert_renders_as_transformers(model_dir, {"tools": TOOLS})
    for tokenizer in (LightTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)):
        with pytest.raises(ValueError, match="default"):
            tokenizer.apply_chat_template(MESSAGES, tokenize=False)


@pytest.mark.parametrize(
    ("file", "text"),
    [
        ("tokenizer.json", "not json {"),
        ("tokenizer.json", '{"a": 1}'),  # JSON, not a tokenizer
        ("tokenizer_config.json", "nope"),
        ("tokenizer_config.json", "[1, 2]"),
        ("config.json", "{"),
    ],
)
def test_a_corrupt_checkpoint_file_is_one_error_line_and_exit_1(
    tiny_model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
    file: str,
    text: str,
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / file).write_text(text)
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--simulate", "h100-llama3-8b"])
    with caplog.at_level(logging.ERROR, logger="corral_cli.simulate"):
        assert run_simulated(args, cmd_engine.engine_args_from(args)) == 1
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert str(model_dir / file) in record.getMessage() and record.exc_info is None
