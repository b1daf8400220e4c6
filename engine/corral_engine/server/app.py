"""The engine's FastAPI app: OpenAI routes, /health, /metrics, wired to one engine."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import inspect
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from corral_engine.chat_template import NO_TEMPLATE_MESSAGE, has_chat_template
from corral_engine.lora import AdapterRegistry
from corral_engine.server import errors, tokens
from corral_engine.server.api_classify import create_classify
from corral_engine.server.api_embeddings import create_embedding, refuse_generation
from corral_engine.server.api_pooling import create_pooling
from corral_engine.server.api_score import create_rerank, create_score
from corral_engine.server.chat import create_chat_completion
from corral_engine.server.completions import create_completion
from corral_engine.server.context import ServerContext
from corral_engine.server.engine_client import EngineClient
from corral_engine.server.lifecycle import log_throughput
from corral_engine.server.lora_routes import adapter_cards, add_lora_routes
from corral_engine.server.metrics import CONTENT_TYPE, ServerMetrics
from corral_engine.server.middleware import ServerMiddleware
from corral_engine.server.reasoning import REASONING_PARSERS
from corral_engine.server.responses import create_response, stored_response

logger = logging.getLogger(__name__)


def fastapi_options() -> dict[str, Any]:
    """FastAPI from 0.16x looks up the global OpenTelemetry providers on every request, even when
    none is configured (~60 µs of the event loop's ~0.9 ms per request on a 2-vCPU machine).
    The engine's own spans (server/tracing.py) cover its requests, so it turns FastAPI's off where
    FastAPI has the option (and with them spans of every scrape and probe once tracing is on)."""
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    return {}


def package_version() -> str:
    """The installed corral distribution's version (as `corral --version` shows it)."""
    try:
        return importlib.metadata.version("corral")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def create_app(
    engine: EngineClient,
    *,
    api_key: str | None = None,
    log_interval_s: float = 10.0,
    tool_call_parser: str | None = None,
    chat_template: str | None = None,
    reasoning_parser: str | None = None,
    log_probe_requests: bool = False,
    adapters: AdapterRegistry | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """An app serving `engine`; its lifespan starts the engine's loop and shuts it down.
    `tool_call_parser`: a name in TOOL_PARSERS, which turns on tool_choice "auto".
    `chat_template`: a template's text (`load_chat_template`), used in place of the tokenizer's.
    `reasoning_parser`: a name in REASONING_PARSERS: chat replies' reasoning is read out of them.
    `log_probe_requests`: successful reads of /health, /metrics and /v1/models get access lines too.
    `adapters`: with --enable-lora, the LoRA adapters served (listed, and named by requests);
    `allow_runtime_lora_updating`: the load and unload endpoints too (--allow-runtime-lora-updating
    or VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}")
    metrics = ServerMetrics(engine.stats, engine.served_model_name, engine.max_model_len)
    ctx = ServerContext(
        engine=engine,
        metrics=metrics,
        api_key=api_key,
        tool_call_parser=tool_call_parser,
        chat_template=chat_template,
        reasoning_parser=reasoning_parser,
        log_probe_requests=log_probe_requests,
        adapters=adapters or AdapterRegistry(),
        is_lora_enabled=adapters is not None,
    )
    if chat_template is None and not has_chat_template(engine.tokenizer):
        logger.warning("%s: %s", engine.served_model_name, NO_TEMPLATE_MESSAGE)  # said once, not per request
    if hasattr(engine, "on_step"):
        engine.on_step = metrics.observe_step
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        ctx.is_ready = True
        logger.info("serving %s (max_model_len %d)", engine.served_model_name, engine.max_model_len)
        logger_task = asyncio.create_task(log_throughput(engine.stats, log_interval_s))
        try:
            yield
        finally:
            ctx.is_ready = False
            logger_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await logger_task
            await engine.shutdown()

    app = FastAPI(
        title="Corral engine",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        **fastapi_options(),
    )
    app.state.ctx = ctx
    errors.install_error_handlers(app)
    app.add_middleware(ServerMiddleware, ctx=ctx)
    # Outermost, so a browser's preflight (which carries no API key) is answered before auth.
    # Any origin, no credentials: vLLM's default; the API key is a bearer token, not a cookie.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    _add_routes(app, ctx, created)
    if adapters is not None and allow_runtime_lora_updating:
        add_lora_routes(app, ctx)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext, created: int) -> None:
    engine, metrics = ctx.engine, ctx.metrics

    def model_card() -> dict[str, object]:
        return {
            "id": engine.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "corral",
            "root": engine.served_model_name,
            "parent": None,  # adapters name this one
            "max_model_len": engine.max_model_len,
        }

    @app.api_route("/health", methods=["GET", "HEAD"])  # some load balancers probe with HEAD
    async def health() -> Response:
        if ctx.is_draining:
            return errors.error_response(errors.draining())
        if not ctx.is_ready:
            return errors.error_response(
                errors.APIError(503, "The engine is starting.", type="service_unavailable_error")
            )
        if not engine.is_running:
            return errors.error_response(
                errors.APIError(503, "The engine is not running.", type="service_unavailable_error")
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(), *adapter_cards(ctx, created)]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        if model == engine.served_model_name:
            return JSONResponse(model_card())
        for card in adapter_cards(ctx, created):
            if card["id"] == model:
                return JSONResponse(card)
        raise errors.model_not_found(model)

    # The generation routes are Starlette's plain routes: each handler parses its own body, so
    # FastAPI's per-request dependency solving and exit stacks would be pure cost (about a tenth
    # of the server's CPU for a short request; docs/engine-speed.md, "The server's work per
    # request").
    async def completions(request: Request) -> Response:
        refuse_generation(ctx, "Completions")
        return await create_completion(ctx, request)

    async def chat_completions(request: Request) -> Response:
        refuse_generation(ctx, "Chat Completions")
        return await create_chat_completion(ctx, request)

    async def embeddings(request: Request) -> Response:
        return await create_embedding(ctx, request)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/embeddings", embeddings, methods=["POST"])

    async def score(request: Request) -> Response:
        return await create_score(ctx, request)

    async def rerank(request: Request) -> Response:
        return await create_rerank(ctx, request)

    for path in ("/v1/score", "/score"):  # vLLM serves both
        app.add_route(path, score, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # /v2: Cohere's clients' path
        app.add_route(path, rerank, methods=["POST"])

    async def classify(request: Request) -> Response:
        return await create_classify(ctx, request)

    for path in ("/classify", "/v1/classify"):  # vLLM's; /v1/classify: SGLang's, for its clients
        app.add_route(path, classify, methods=["POST"])

    async def pooling(request: Request) -> Response:
        return await create_pooling(ctx, request)

    app.add_route("/pooling", pooling, methods=["POST"])

    async def responses(request: Request) -> Response:
        refuse_generation(ctx, "Responses")
        return await create_response(ctx, request)

    app.add_route("/v1/responses", responses, methods=["POST"])
    app.add_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])
    app.add_route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"])
    app.add_route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokens.tokenize(ctx, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await tokens.detokenize(ctx, request)
