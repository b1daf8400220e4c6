"""A large body is validated off the event loop, and its errors stop at the first bad item: a
32 MiB conversation must not hold every other stream and /health while it is read."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest
from corral_engine.server.api_chat import ChatCompletionRequest
from corral_engine.server.api_responses import ResponsesRequest
from corral_engine.server.context import OFF_LOOP_BODY_BYTES, OFF_LOOP_CHARS
from pydantic import ValidationError

from tests.server.fake_engine import FakeEngine

MODEL = FakeEngine.served_model_name
H, R = "/v1/chat/completions", "/v1/responses"
# Past OFF_LOOP_BODY_BYTES: ~30 bytes a message.
MANY_MESSAGES = [{"role": "user", "content": "hi"}] * (OFF_LOOP_BODY_BYTES // 16)


LARGE_BODIES = [  # (path, body, a step of its validation: the class and its method)
    (
        H,
        {"model": MODEL, "messages": MANY_MESSAGES, "truncate_prompt_tokens": 8},
        ChatCompletionRequest,
        "check_fields",
    ),
    # A Responses request is validated again as chat's: that too is off the loop.
    # (Large in a field the prompt leaves out: a Responses request cannot truncate its prompt.)
    (R, {"model": MODEL, "input": "hi", "user": "u" * OFF_LOOP_BODY_BYTES}, ResponsesRequest, "chat_request"),
]


@pytest.mark.parametrize(("path", "body", "model", "step"), LARGE_BODIES)
async def test_a_large_body_is_validated_while_the_server_answers_others(
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: dict[str, Any],
    model: Any,
    step: str,
) -> None:
    order: list[str] = []
    validating, health_answered = threading.Event(), threading.Event()
    original = getattr(model, step)

    def held(self: Any) -> Any:
        # Validation finishes only once /health has been answered: on the event loop, /health
        # could not be (the wait would run out first and the order below would be reversed).
        validating.set()
        health_answered.wait(timeout=10)
        order.append(f"validated on {threading.current_thread().name}")
        return original(self)

    monkeypatch.setattr(model, step, held)
    assert len(json.dumps(body)) > OFF_LOOP_BODY_BYTES
    post = asyncio.create_task(client.post(path, json={**body, "max_tokens": 2}))
    while not validating.is_set() and not post.done():
        await asyncio.sleep(0.01)
    health = await client.get("/health")
    order.append(f"health {health.status_code}")
    health_answered.set()
    response = await post
    assert response.status_code == 200, response.text
    assert order[0] == "health 200", order
    assert order[1].startswith("validated on corral-parse"), order


async def test_a_small_body_is_validated_in_place(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    check_fields = ChatCompletionRequest.check_fields

    def noting(self: ChatCompletionRequest) -> None:
        threads.append(threading.current_thread().name)
        check_fields(self)

    monkeypatch.setattr(ChatCompletionRequest, "check_fields", noting)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = await client.post(H, json=body)
    assert response.status_code == 200, response.text
    assert threads == [threading.current_thread().name]


async def test_a_large_body_refused_off_the_loop_gets_the_usual_errors(client: httpx.AsyncClient) -> None:
    wrong_model = {"model": "nope", "messages": MANY_MESSAGES}
    response = await client.post(H, json=wrong_model)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    bad = {"model": MODEL, "messages": [*MANY_MESSAGES, {"role": "tool", "content": "x"}]}
    response = await client.post(H, json=bad)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == f"messages.{len(MANY_MESSAGES)}" and "tool_call_id" in error["message"]


def _errors(model: Any, body: dict[str, Any]) -> list[Any]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(json.dumps(body))
    return list(caught.value.errors())


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}] * 1000}),
        (
            ChatCompletionRequest,
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}] * 1000}]},
        ),
        (ResponsesRequest, {"model": MODEL, "input": [{"role": "user", "content": 5}] * 1000}),
        (
            ResponsesRequest,
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}] * 1000}]},
        ),
    ],
)
def test_validation_stops_at_the_first_bad_item(model: Any, body: dict[str, Any]) -> None:
    """Listing 300k errors of a 10 MB body cost as much as validating it; one is reported."""
    errors = _errors(model, body)
    indexes = {part for e in errors for part in e["loc"] if isinstance(part, int)}
    assert indexes == {0}, errors[:3]


def test_a_conversation_is_measured_on_the_loop_only_until_it_is_long() -> None:
    """Whether it is rendered off the event loop is decided on it: a million parts are not all
    counted there (that took 0.3 s), only enough to pass the bar."""
    part = {"type": "text", "text": "hi"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part] * 100_000}]}
    req = ChatCompletionRequest.model_validate(body)
    assert OFF_LOOP_CHARS <= req.num_chars(at_most=OFF_LOOP_CHARS) < OFF_LOOP_CHARS + len("hi") + 1
    short = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert short.num_chars(at_most=OFF_LOOP_CHARS) == len(json.dumps([None, None])) + len("hi") + 1
