"""Fakes for gateway unit tests: a tiny engine-like app and an in-loop uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from corral_engine import wire
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeEngine:
    """Behaviour knobs for one fake replica; `mode` applies to completion requests."""

    name: str = "fake"
    # ok | error500 | die_midstream | die_mid_event | die_after_done | die_before_first_event
    # | cut_body | cut_chunked | hang | reject429
    mode: str = "ok"
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_chunks: int = 3
    chunk_delay_s: float = 0.0
    answer_delay_s: float = 0.0  # before answering a completion request at all
    first_event_delay_s: float = 0.0  # a stream's head is sent at once, its first event after this
    num_queue_full: int = 0  # the next this many completion requests get the engine's queue-full 429
    num_refused: int = 0
    refusal_retry_after: str = "1"  # the queue-full 429's Retry-After
    end_gate: asyncio.Event | None = None  # when given, a stream waits for it before its `[DONE]`
    bodies: list[bytes] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    num_active: int = 0  # requests being served right now
    num_cancelled: int = 0
    is_healthy: bool = True
    health_has_load: bool = False  # like Corral's engine: load headers on /health too
    num_metrics_scrapes: int = 0
    served_names: tuple[str, ...] = ("m",)  # what its /v1/models lists
    # LoRA adapters it lists too (name -> root), as children of its first served name.
    adapters: dict[str, str] = field(default_factory=dict)
    lora_info: str = ""  # extra /metrics lines (vllm:lora_requests_info)
    num_model_lists: int = 0
    num_health_polls: int = 0
    models_version: str | None = None  # like Corral's engine with LoRA on: on every load header set
    models_authorization: str | None = None  # the last model list request's
    lora_load_status: int = 200  # what a runtime adapter load answers (vLLM's routes); 200: it loads
    lora_calls: list[tuple[str, str]] = field(default_factory=list)  # (load | unload, lora_name)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/metrics", self.metrics),
                Route("/health", self.health),
                Route("/v1/models", self.models),
                Route("/tokenize", self.echo, methods=["POST"]),
                *(Route(path, self.echo, methods=["POST"]) for path in ("/score", "/rerank", "/v2/rerank")),
                Route("/v1/load_lora_adapter", self.load_lora, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora, methods=["POST"]),
                Route("/v1/{rest:path}", self.echo, methods=["POST"]),
            ]
        )

    def load_headers(self) -> dict[str, str]:
        version = {} if self.models_version is None else {wire.HEADER_MODELS_VERSION: self.models_version}
        return {
            wire.HEADER_NUM_RUNNING: str(self.num_running),
            wire.HEADER_NUM_WAITING: str(self.num_waiting),
            wire.HEADER_KV_USAGE: str(self.kv_usage),
            **version,
        }

    async def health(self, request: Request) -> Response:
        self.num_health_polls += 1
        headers = self.load_headers() if self.health_has_load else None
        return JSONResponse(
            {"ok": self.is_healthy}, status_code=200 if self.is_healthy else 503, headers=headers
        )

    async def models(self, request: Request) -> Response:
        self.num_model_lists += 1
        self.models_authorization = request.headers.get("authorization")
        card = {"object": "model", "created": 1700000000, "owned_by": "fake", "max_model_len": 4096}
        data = [{"id": name, **card, "root": f"/models/{name}", "parent": None} for name in self.served_names]
        base = self.served_names[0] if self.served_names else None
        data += [{"id": name, **card, "root": root, "parent": base} for name, root in self.adapters.items()]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora(self, request: Request) -> Response:
        """vLLM's runtime load: 400 for a name it serves already, else `lora_load_status`."""
        body = json.loads(await request.body())
        name = body["lora_name"]
        self.lora_calls.append(("load", name))
        if name in self.adapters:
            error = {
                "message": f"The lora adapter '{name}' has already been loaded.",
                "type": "BadRequestError",
            }
            return JSONResponse({"error": {**error, "param": "lora_name", "code": 400}}, status_code=400)
        if self.lora_load_status != 200:
            error = {
                "message": "No adapter found",
                "type": "NotFoundError",
                "param": "lora_path",
                "code": "x",
            }
            return JSONResponse({"error": error}, status_code=self.lora_load_status)
        self.adapters[name] = body["lora_path"]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: Request) -> Response:
        name = json.loads(await request.body())["lora_name"]
        self.lora_calls.append(("unload", name))
        if self.adapters.pop(name, None) is None:
            return JSONResponse({"error": {"message": "not found"}}, status_code=404)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def metrics(self, request: Request) -> Response:
        self.num_metrics_scrapes += 1
        values = {
            wire.NUM_REQUESTS_RUNNING: self.num_running,
            wire.NUM_REQUESTS_WAITING: self.num_waiting,
            wire.KV_CACHE_USAGE_PERC: self.kv_usage,
        }
        text = "".join(f'# TYPE {n} gauge\n{n}{{model_name="m"}} {v}\n' for n, v in values.items())
        return PlainTextResponse(text + self.lora_info)

    async def echo(self, request: Request) -> Response:
        """Any other POST route: what arrived (path, body length, content type) and who answered."""
        raw = await request.body()
        self.bodies.append(raw)
        self.headers_seen.append(dict(request.headers))
        if self.mode == "error500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        seen = {
            "path": request.url.path,
            "num_bytes": len(raw),
            "content_type": request.headers.get("content-type"),
        }
        return JSONResponse({**seen, "replica": self.name}, headers=self.load_headers())

    async def completions(self, request: Request) -> Response:
        raw = await request.body()
        self.bodies.append(raw)
        self.headers_seen.append(dict(request.headers))
        await asyncio.sleep(self.answer_delay_s)
        if self.mode == "error500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if self.num_queue_full > 0:
            self.num_queue_full -= 1
            self.num_refused += 1
            error = {
                "message": "queue full",
                "type": "rate_limit_error",
                "param": None,
                "code": wire.CODE_QUEUE_FULL,
            }
            retry_after = {"retry-after": self.refusal_retry_after}
            return JSONResponse({"error": error}, status_code=429, headers=retry_after)
        if self.mode == "reject429":
            return JSONResponse({"error": {"message": "full"}}, status_code=429, headers={"retry-after": "1"})
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": {"message": "bad json", "type": "invalid_request_error"}}, 400)
        if not isinstance(body, dict) or not body.get("stream"):
            if self.mode == "hang":
                # Like a real engine: work until the caller hangs up, then abort.
                self.num_active += 1
                try:
                    while not await request.is_disconnected():
                        await asyncio.sleep(0.01)
                    self.num_cancelled += 1
                finally:
                    self.num_active -= 1
                return Response(status_code=499)
            if self.mode == "cut_body":  # dies while sending a non-streamed body
                cut = {"content-length": "200"}
                return Response(b'{"id": "x", "cho', media_type="application/json", headers=cut)
            if self.mode == "cut_chunked":  # dies while sending a body of no declared length
                return StreamingResponse(self._cut_body(), media_type="application/json")
            usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
            return JSONResponse(
                {"id": "x", "served_by": self.name, "usage": usage}, headers=self.load_headers()
            )
        return StreamingResponse(self._stream(), media_type="text/event-stream", headers=self.load_headers())

    async def _stream(self) -> AsyncIterator[bytes]:
        self.num_active += 1
        try:
            await asyncio.sleep(self.first_event_delay_s)  # the head is out, the prompt queued
            if self.mode == "die_before_first_event":
                raise RuntimeError("replica died")
            for i in range(self.num_chunks):
                event = f'data: {{"i": {i}, "served_by": "{self.name}"}}\n\n'.encode()
                if self.mode == "die_mid_event" and i == 1:
                    yield event[:13]  # the replica dies within an event
                    raise RuntimeError("replica died")
                yield event
                if self.mode == "die_midstream" and i == 0:
                    raise RuntimeError("replica died")
                await asyncio.sleep(self.chunk_delay_s)
                if self.mode == "hang":
                    await asyncio.sleep(3600)
            if self.end_gate is not None:
                await self.end_gate.wait()
            yield b"data: [DONE]\n\n"
            if self.mode == "die_after_done":  # the body's own end is lost
                raise RuntimeError("replica died")
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        finally:
            self.num_active -= 1

    async def _cut_body(self) -> AsyncIterator[bytes]:
        yield b'{"id": "x", "choices": ['
        await asyncio.sleep(0.01)
        raise RuntimeError("replica died")


async def start_serving(server: uvicorn.Server) -> tuple[asyncio.Task[None], int]:
    """`server` serving in the current event loop, once it listens: (its task, its port)."""
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return task, server.servers[0].sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Run `app` with uvicorn on 127.0.0.1 and a free port inside the current event loop."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on")
    server = uvicorn.Server(config)
    task, port = await start_serving(server)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        # A plain exit runs the app's lifespan shutdown (the fleet's pollers stop, the shared
        # client closes). force_exit would skip it and leave the lifespan suspended, to be
        # collected later with a "coroutine ignored GeneratorExit" warning; it is only the
        # fallback for a response that never ends.
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 5)
        except TimeoutError:
            server.force_exit = True
            await asyncio.wait_for(task, 10)


@pytest.fixture
def fake_engine_factory() -> type[FakeEngine]:
    return FakeEngine
