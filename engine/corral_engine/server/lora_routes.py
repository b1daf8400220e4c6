"""LoRA adapters in the API: their /v1/models cards, and vLLM's runtime endpoints
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (registered only where runtime
updating is allowed; elsewhere they are unknown routes, 404, as in vLLM)."""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol, cast

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from corral_engine.lora import AdapterError, LoraRequest
from corral_engine.server import errors
from corral_engine.server.context import ServerContext, read_body

logger = logging.getLogger(__name__)


class LoraEngine(Protocol):
    """What an engine serving adapters offers besides EngineClient."""

    async def add_lora(self, lora: LoraRequest) -> None: ...

    def remove_lora(self, lora_id: int) -> None: ...


def adapter_cards(ctx: ServerContext, created: int) -> list[dict[str, Any]]:
    """One /v1/models entry per served adapter, as vLLM lists them."""
    return [
        {
            "id": lora.name,
            "object": "model",
            "created": created,
            "owned_by": "corral",
            "root": lora.path,
            "parent": lora.base_model_name or ctx.model_name,
            "max_model_len": ctx.engine.max_model_len,
        }
        for lora in ctx.adapters.all()
    ]


async def _fields(request: Request, names: tuple[str, ...]) -> list[str]:
    """The body's string fields `names`, each required (400 otherwise)."""
    try:
        body = json.loads(await read_body(request) or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise errors.invalid_request("The body is not valid JSON.") from None
    values = [body.get(name) if isinstance(body, dict) else None for name in names]
    if not all(isinstance(v, str) and v for v in values):
        wanted = " and ".join(f"'{n}'" for n in names)
        raise errors.invalid_request(f"{wanted} must be provided.", names[0])
    return cast(list[str], values)


def add_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    """The load and unload endpoints, on an engine that serves adapters."""
    engine = cast(LoraEngine, ctx.engine)
    loading: set[str] = set()  # names being loaded now: a second load of one is refused

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        name, path = await _fields(request, ("lora_name", "lora_path"))
        if name in ctx.adapters or name in loading or name == ctx.model_name:
            raise errors.invalid_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        lora = ctx.adapters.new(name, path)
        loading.add(name)
        try:
            await engine.add_lora(lora)
        except AdapterError as e:
            raise errors.invalid_request(str(e), "lora_path") from None
        finally:
            loading.discard(name)
        ctx.adapters.add(lora)
        logger.info("loaded LoRA adapter %r from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        (name,) = await _fields(request, ("lora_name",))
        lora = ctx.adapters.remove(name)
        if lora is None:
            raise errors.APIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found"
            )
        engine.remove_lora(lora.lora_id)
        logger.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
