"""--chat-template: a file or the template itself renders chat requests and /tokenize's messages in
place of the tokenizer's; a bad one stops start-up naming the flag; a model with no template at all
says so once at start-up and in each chat request's 400 (real engine on a tiny demo model)."""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import shutil
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from corral_cli import cmd_engine
from corral_engine import AsyncEngine, EngineArgs
from corral_engine.args import ArgumentError
from corral_engine.chat_template import load_chat_template
from corral_engine.server import create_app

from tests.server.test_engine_cli import parse

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
CHAT = {"messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def untemplated_model_dir(
    tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> pathlib.Path:
    """The tiny model without a chat template: tokenizer_config.json has no `chat_template`."""
    model_dir = tmp_path_factory.mktemp("untemplated") / "tiny-untemplated"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return model_dir


@contextlib.asynccontextmanager
async def serving(
    model_dir: pathlib.Path, chat_template: str | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """The engine server as `corral engine` builds it: the flag's value read at start-up."""
    args = EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=64, chat_template=chat_template)
    app = create_app(AsyncEngine(args), chat_template=load_chat_template(chat_template))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            yield c


async def tokenize_chat(client: httpx.AsyncClient) -> list[int]:
    r = await client.post("/tokenize", json=CHAT)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


async def chat(client: httpx.AsyncClient, model_dir: pathlib.Path) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"model": model_dir.name, **CHAT, "max_tokens": 2})


@pytest.mark.parametrize("given_as", ["file", "inline"])
async def test_the_given_template_renders_chat_and_tokenize(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, given_as: str
) -> None:
    value = TEMPLATE
    if given_as == "file":
        (tmp_path / "chat.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "chat.jinja")
    async with serving(tiny_model_dir) as c:
        model_tokens = await tokenize_chat(c)
    async with serving(tiny_model_dir, value) as c:
        tokens = await tokenize_chat(c)
        r = await chat(c, tiny_model_dir)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tokens)
        detok = await c.post("/detokenize", json={"tokens": tokens})
    assert tokens != model_tokens
    assert detok.json()["prompt"] == "[user] hello there\n[assistant]"


async def test_a_model_without_a_template_warns_once_and_refuses_chat_naming_the_flag(
    untemplated_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with serving(untemplated_model_dir) as c:
            r = await chat(c, untemplated_model_dir)
            t = await c.post("/tokenize", json=CHAT)
            plain = await c.post("/tokenize", json={"prompt": "hello"})
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    said = [w for w in warnings if "no chat template" in w]
    assert len(said) == 1 and "--chat-template" in said[0], warnings
    for response in (r, t):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
        assert error["param"] == "messages"
    assert plain.status_code == 200  # only rendering a conversation needs a template


async def test_a_model_without_a_template_serves_chat_with_the_flag(
    untemplated_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with serving(untemplated_model_dir, TEMPLATE) as c:
            r = await chat(c, untemplated_model_dir)
    assert r.status_code == 200, r.text
    assert not [rec for rec in caplog.records if "no chat template" in rec.getMessage()]


def test_a_template_file_is_read_and_a_transformers_generation_block_compiles(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(
        "{% for m in messages %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
    )
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template(TEMPLATE) == TEMPLATE
    long = "{{ bos_token }}" + "x" * 5000  # longer than any file name: a template, not an error
    assert load_chat_template(long) == long


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("/no/such/template.jinja", "no such file: /no/such/template.jinja"),
        ("{% for m in messages %}{{ m.content }}", "does not compile"),
        ("{{ messages | no_such_filter }}", "does not compile"),
    ],
)
def test_a_missing_file_or_broken_template_is_an_error_naming_the_flag(value: str, says: str) -> None:
    with pytest.raises(ArgumentError, match="--chat-template") as info:
        load_chat_template(value)
    assert says in str(info.value)


def test_corral_engine_refuses_a_broken_template_before_loading_the_model(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def must_not_load(*_: object) -> None:
        raise AssertionError("the model was loaded before the template was checked")

    monkeypatch.setattr(cmd_engine, "_start_engine", must_not_load)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["--model", str(tiny_model_dir), "--port", str(port), "--chat-template", "{% if %}"]
    with caplog.at_level(logging.ERROR):
        assert cmd_engine.run(parse(argv)) == 2
    assert "--chat-template: the template does not compile" in caplog.text


async def test_a_simulated_engine_renders_the_given_template(untemplated_model_dir: pathlib.Path) -> None:
    import argparse

    from corral_cli.simulate import replica_spec
    from corral_engine.sim.host import build_engines

    spec = replica_spec(
        argparse.Namespace(simulate="h100-llama3-8b"),
        EngineArgs(model=str(untemplated_model_dir), chat_template=TEMPLATE),
    )
    [engine] = build_engines(spec, 1)
    app = create_app(engine, chat_template=spec.chat_template)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            tokens = await tokenize_chat(c)
            detok = await c.post("/detokenize", json={"tokens": tokens})
    assert detok.json()["prompt"] == "[user] hello there\n[assistant]"
