"""A tiny OpenAI-compatible SSE server for unit tests of the bench client (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeState:
    num_in_flight: int = 0
    max_in_flight: int = 0
    num_preemptions: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of every request, models list too
    token_delay_s: float = 0.0
    num_tokens_sent: list[int] = field(default_factory=list)  # per stream, once it has ended
    tokens_per_chunk: int = 1  # as a server that merges the tokens of a slow consumer sends them
    api_key: str | None = None  # set: every /v1 route wants 'Authorization: Bearer api_key'
    is_gateway: bool = False  # /metrics without the engines' counters, as a gateway's


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _unauthorized(state: FakeState, request: Request) -> JSONResponse | None:
    """The 401 an OpenAI-compatible server answers a wrong or missing key with; None if it is right."""
    if state.api_key is None or request.headers.get("authorization") == f"Bearer {state.api_key}":
        return None
    error = {
        "message": "Incorrect API key provided.",
        "type": "invalid_request_error",
        "code": "invalid_api_key",
    }
    return JSONResponse({"error": error}, status_code=401)


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        state.headers.append(dict(request.headers))
        if refused := _unauthorized(state, request):
            return refused
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if state.is_gateway:
            return PlainTextResponse(
                "# TYPE corral_gateway_queue_length gauge\ncorral_gateway_queue_length 0\n"
            )
        text = (
            "# HELP vllm:num_preemptions_total Preemptions.\n# TYPE vllm:num_preemptions_total counter\n"
            f'vllm:num_preemptions_total{{model_name="{MODEL}"}} {float(state.num_preemptions)}\n'
        )
        return PlainTextResponse(text)

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        state.num_in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.num_in_flight)
        num_sent = 0
        try:
            if chat:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            num_tokens = int(body["max_tokens"])
            prompt = body.get("prompt")
            num_prompt = len(prompt) if isinstance(prompt, list) else 7
            options = body.get("stream_options") or {}
            is_continuous = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
            for i in range(0, num_tokens, state.tokens_per_chunk):
                if i == 1 and prompt == "midfail":
                    yield _sse({"error": {"message": "engine died", "type": "internal_error"}})
                    return
                if i == 1 and prompt == "cut":
                    return  # the connection ends without [DONE]
                await asyncio.sleep(state.token_delay_s)
                count = min(state.tokens_per_chunk, num_tokens - i)
                piece = "".join("é" if k % 2 else " a" for k in range(i, i + count))
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                event: dict[str, Any] = {"choices": [choice]}
                num_sent += count
                if is_continuous:
                    event["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": num_sent}
                yield _sse(event)
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens}
            yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
            state.num_preemptions += 1
        finally:  # also when the client closes the stream early (the task is cancelled)
            state.num_in_flight -= 1
            state.num_tokens_sent.append(num_sent)

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.bodies.append(body)
        state.headers.append(dict(request.headers))
        if refused := _unauthorized(state, request):
            return refused
        text = body["messages"][0]["content"] if chat else body.get("prompt")
        if text == "fail" or body.get("model") != MODEL:
            error = {"message": "no such thing", "type": "invalid_request_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=400)
        if body.get("stream") is False:
            num_tokens = int(body["max_tokens"])
            await asyncio.sleep(state.token_delay_s * num_tokens)
            text = "".join("é" if k % 2 else " a" for k in range(num_tokens))
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            prompt = body.get("prompt")
            usage = {
                "prompt_tokens": len(prompt) if isinstance(prompt, list) else 7,
                "completion_tokens": num_tokens,
            }
            return JSONResponse({"choices": [{**choice, "finish_reason": "length"}], "usage": usage})
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        """A vector per input; usage counts each input's tokens and 2 more, as an encoder's
        [CLS]/[SEP] (a text input counts as 7 tokens)."""
        body = await request.json()
        state.bodies.append(body)
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if body.get("model") != MODEL:
            error = {
                "message": "no such model",
                "type": "invalid_request_error",
                "param": "model",
                "code": None,
            }
            return JSONResponse({"error": error}, status_code=404)
        await asyncio.sleep(state.token_delay_s)
        data = [{"object": "embedding", "index": i, "embedding": [0.6, 0.8]} for i in range(len(inputs))]
        num_tokens = sum((len(x) if isinstance(x, list) else 7) + 2 for x in inputs)
        return {
            "object": "list",
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


@contextmanager
def serve_fake(state: FakeState | None = None) -> Iterator[tuple[str, FakeState]]:
    """Run the fake server in a thread; yields (base_url, state)."""
    state = state or FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(state), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
