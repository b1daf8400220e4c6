"""A conversation whose user turns alone cannot fit the context is refused before the chat template
renders it (300k short messages took seconds to render, then got the same 400); text a template may
leave out (whitespace around a turn, an assistant's thinking, a role it skips) never counts."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.fake_engine import FakeEngine

MODEL = FakeEngine.served_model_name
H = "/v1/chat/completions"
# The fake vocabulary's longest token is "<s>": at most 3 x 4 (normalization) characters a token, so
# 256 tokens' worth is 3072 characters.
BOUND_CHARS = 256 * 3 * 4


def _renders(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of messages of each conversation the template renders."""
    rendered: list[int] = []
    render = engine.tokenizer.apply_chat_template

    def recording(messages: list[dict[str, Any]], **kw: Any) -> str:
        rendered.append(len(messages))
        return render(messages, **kw)

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", recording)
    return rendered


def _user_turns(num_chars: int, num_turns: int) -> list[dict[str, str]]:
    size = num_chars // num_turns
    turns = [{"role": "user", "content": "x" * size} for _ in range(num_turns)]
    turns[0]["content"] += "x" * (num_chars - size * num_turns)
    return turns


@pytest.mark.parametrize("num_turns", [1, 1536])
async def test_user_turns_too_long_to_fit_are_refused_unrendered(
    client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, num_turns: int
) -> None:
    rendered = _renders(engine, monkeypatch)
    body = {"model": MODEL, "messages": _user_turns(BOUND_CHARS, num_turns), "max_tokens": 2}
    refused = await client.post(H, json=body)
    assert refused.status_code == 400 and rendered == []
    # One character fewer is rendered, then refused as every rendering too long to fit is: alike.
    body["messages"] = _user_turns(BOUND_CHARS - 1, num_turns)
    rendered_then_refused = await client.post(H, json=body)
    assert rendered_then_refused.status_code == 400 and rendered == [num_turns]
    first, then = refused.json()["error"], rendered_then_refused.json()["error"]
    assert {k: first[k] for k in ("type", "code", "param")} == {k: then[k] for k in ("type", "code", "param")}
    assert first["param"] == "messages"
    prefix = "This model's maximum context length is 256 tokens; the "
    assert first["message"].startswith(prefix) and then["message"].startswith(prefix)
    assert f"({BOUND_CHARS} characters) has at least 256." in first["message"]
    assert engine.requests == {}


async def test_truncated_user_turns_are_rendered(
    client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = _renders(engine, monkeypatch)
    body = {"model": MODEL, "messages": _user_turns(BOUND_CHARS, 1), "max_tokens": 2}
    response = await client.post(H, json={**body, "truncate_prompt_tokens": 8})
    assert response.status_code == 200, response.text
    assert rendered == [1] and response.json()["usage"]["prompt_tokens"] == 8


def _leaving_out(messages: list[dict[str, Any]], **kw: Any) -> str:
    """A template as real ones are: user turns trimmed (Llama 3's, Gemma's), an assistant turn's
    thinking dropped (DeepSeek-R1's), roles it does not know skipped."""
    text = ""
    for m in messages:
        if m["role"] == "user":
            text += f"<user>{m['content'].strip()}\n"
        elif m["role"] == "assistant":
            text += f"<assistant>{m['content'].split('</think>')[-1]}\n"
    return text + "<assistant>"


async def test_text_a_template_leaves_out_does_not_count(
    client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", _leaving_out)
    far_past = "x" * (2 * BOUND_CHARS)
    messages = [
        {"role": "system", "content": far_past},
        {"role": "user", "content": " " * BOUND_CHARS + "hi" + "\n" * BOUND_CHARS},
        {"role": "assistant", "content": f"<think>{far_past}</think>hello"},
        {
            "role": "user",
            "content": [{"type": "text", "text": " " * BOUND_CHARS}, {"type": "text", "text": "ok"}],
        },
    ]
    response = await client.post(H, json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    rendered = "<user>hi\n<assistant>hello\n<user>ok\n<assistant>"  # bytes are tokens
    assert response.json()["usage"]["prompt_tokens"] == len(rendered)
