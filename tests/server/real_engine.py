"""An engine server over a real AsyncEngine on a tiny random-weight demo model, reached in-process
by the official `openai` client (ASGI transport, no socket)."""

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
