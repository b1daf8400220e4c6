"""An engine server over a real AsyncEngine on a tiny random-weight demo model, reached in-process
by the official `openai` client or by httpx (ASGI transport, no socket)."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
from corral_engine import AsyncEngine, EngineArgs, EngineCoreClient
from corral_engine.server import create_app
from corral_engine.settings import EngineSettings


@contextlib.asynccontextmanager
async def openai_client(
    model_dir: pathlib.Path,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    settings: EngineSettings | None = None,
    app_kwargs: dict[str, Any] | None = None,
    **args: Any,
) -> AsyncIterator[openai.AsyncOpenAI]:
    """`app_kwargs`: create_app's further arguments (LoRA adapters, the load endpoints)."""
    args.setdefault("num_kv_blocks", 256)
    engine_args = EngineArgs(model=str(model_dir), dtype="float32", **args)
    engine: AsyncEngine | EngineCoreClient
    if settings is not None and settings.engine_process == "1":  # the engine core in its own process
        engine = EngineCoreClient(engine_args, settings=settings)
    else:
        engine = AsyncEngine(engine_args, settings=settings)
    app = create_app(
        engine, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, **(app_kwargs or {})
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            yield openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0
            )


@contextlib.asynccontextmanager
async def http_client(
    model_dir: pathlib.Path, in_own_process: bool = False, **args: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """httpx on the server of a float32 engine (its core in its own process where asked): for the
    routes the openai client has no call for (score, rerank, classify)."""
    engine_args = EngineArgs(model=str(model_dir), dtype="float32", **args)
    engine: AsyncEngine | EngineCoreClient
    if in_own_process:
        engine = EngineCoreClient(engine_args, settings=EngineSettings(engine_process="1"))
    else:
        engine = AsyncEngine(engine_args)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            yield http


def assert_invalid_request(resp: httpx.Response, status: int, param: str | None, text: str) -> None:
    """An OpenAI-shaped invalid_request_error naming `param`, its message holding `text`."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert text in error["message"]
