"""The gateway's FastAPI app: routes, start-up and shutdown of the shared client and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import inspect
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from corral_engine import wire
from fastapi import FastAPI, Request
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from corral_gateway.access import AccessLog, request_id_for
from corral_gateway.adapter_fanout import AdapterFanout
from corral_gateway.auth import KeysFile
from corral_gateway.drain import Drain
from corral_gateway.errors import (
    Draining,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    Unauthorized,
    Unavailable,
    error_response,
)
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import KubernetesWatcher
from corral_gateway.k8s_wake import Waker
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.paths import is_proxied
from corral_gateway.proxy import ProxyDeps, proxy, read_body, with_request_id
from corral_gateway.runtime_adapters import LOAD_PATH, UNLOAD_PATH
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import Upstream, UpstreamConfig

logger = logging.getLogger(__name__)


class GatewayApp:
    """ASGI entry: proxied requests go straight to the proxy (FastAPI never sees them; other
    methods on the two generation routes get 405), everything else to FastAPI.

    Skipping FastAPI's middleware stack matters on the hot path: every streamed chunk would
    otherwise pass through each middleware's `send` wrapper. For the same reason the proxy puts
    `x-request-id` on its answers itself; every other response gets it from a wrapper here.
    """

    def __init__(self, api: FastAPI, deps: dict[str, ProxyDeps], drain: Drain) -> None:
        self.api = api
        self._deps = deps
        self.drain = drain  # begun by the server on SIGTERM (`drain.DrainingServer`)
        # Browsers may call it from any origin, without credentials (vLLM's default and the
        # engine's). Outermost: a preflight carries no API key. A request without an Origin header
        # passes straight through, and only a browser's gets its send wrapped.
        self._cors = CORSMiddleware(
            self._dispatch, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.drain.is_draining:
            send = _closing(send)
        # A proxied request's answers carry the id the proxy took; every other response (a route
        # of FastAPI's, a 405 on a generation route, a browser's preflight) gets one here.
        if scope["type"] != "http" or (scope["method"] == "POST" and is_proxied("POST", scope["path"])):
            await self._cors(scope, receive, send)
            return
        request_id = request_id_for(Headers(scope=scope))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).setdefault(wire.HEADER_REQUEST_ID, request_id)
            await send(message)

        await self._cors(scope, receive, send_with_id)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_proxied(scope["method"], scope["path"]):
            if scope["method"] != "POST":
                await error_response(MethodNotAllowed("Method Not Allowed"))(scope, receive, send)
                return
            deps = self._deps.get("deps")
            if deps is not None:
                await self._proxy(deps, scope, receive, send)
                return
        await self.api(scope, receive, send)

    async def _proxy(self, deps: ProxyDeps, scope: Scope, receive: Receive, send: Send) -> None:
        is_started = False
        request = Request(scope, receive)
        request_id = request_id_for(request.headers)

        async def deliver(response: Response) -> None:
            nonlocal is_started
            is_started = True
            await response(scope, receive, send)

        try:
            await proxy(deps, request, scope["path"], request_id, deliver)
        except Exception:  # the edge's last resort: a bug must still answer in OpenAI's shape
            if is_started:
                raise  # too late for another answer: the server logs it and closes the connection
            logger.exception(
                "request %s: unexpected error proxying %s",
                request_id,
                scope["path"],
                extra={"request_id": request_id},
            )
            failed = with_request_id(error_response(GatewayError("Internal gateway error.")), request_id)
            await failed(scope, receive, send)


def _closing(send: Send) -> Send:
    """`send`, telling the client to close its connection after this response: a client whose
    pooled keep-alive connection reaches a draining gateway reconnects (through its Service, to
    another gateway) rather than sending it more requests."""

    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            MutableHeaders(scope=message)["connection"] = "close"
        await send(message)

    return send_closing


def fastapi_options() -> dict[str, Any]:
    """FastAPI from 0.16x traces its own routes once a tracer provider is installed: with
    `--otlp-traces-endpoint`, every Prometheus scrape and probe (/metrics, /health, /ready) became a
    trace of three spans. The gateway's own spans cover the requests it proxies; FastAPI's are off
    (and so is its per-request provider check), as in the engine."""
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    return {}


def create_app(settings: GatewaySettings) -> GatewayApp:
    metrics = GatewayMetrics()
    fleet = Fleet(settings, metrics)
    keys = KeysFile(settings.api_keys_file)
    state: dict[str, ProxyDeps] = {}
    fanouts: dict[str, AdapterFanout] = {}  # the one, once the upstream client is open
    drain = Drain(settings.drain_timeout_s)
    drain.on_begin.append(fleet.stop_queueing)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _background(settings, fleet, keys) as upstream:
            access = AccessLog(metrics, settings.access_log)
            state["deps"] = ProxyDeps(settings, fleet, upstream, metrics, keys.get, access, drain)
            fanout = fanouts["fanout"] = AdapterFanout(fleet, upstream, settings)
            fleet.on_lacking_adapters = fanout.restore_soon
            try:
                yield
            finally:
                fleet.on_lacking_adapters = None
                await fanout.close()

    app = FastAPI(
        title="Corral gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        **fastapi_options(),
    )
    app.state.fleet = fleet
    app.state.metrics = metrics
    _add_error_handlers(app)
    _add_routes(app, fleet, keys, metrics, drain, settings.metrics_require_auth)
    _add_adapter_routes(app, keys, fanouts, settings.max_request_bytes)
    return GatewayApp(app, state, drain)


@asynccontextmanager
async def _background(settings: GatewaySettings, fleet: Fleet, keys: KeysFile) -> AsyncIterator[Upstream]:
    """The shared upstream client and the background tasks (load polls, key reloads, discovery)."""
    config = UpstreamConfig(
        settings.max_connections,
        settings.connect_timeout_s,
        settings.first_byte_timeout_s,
        settings.response_timeout_s,
    )
    async with Upstream(config) as upstream:
        tasks = [asyncio.create_task(fleet.run(upstream), name="fleet")]
        tasks.append(asyncio.create_task(fleet.loop_lag.run(), name="loop lag"))
        tasks.append(asyncio.create_task(keys.watch()))
        watcher = None
        if settings.kubernetes.enabled:
            if settings.kubernetes.wake_from_zero:
                fleet.waker = Waker(settings.kubernetes.kubeconfig)
            watcher = KubernetesWatcher(settings.kubernetes, fleet.apply_discovery)
            watcher.start(asyncio.get_running_loop())
        try:
            yield upstream
        finally:
            if watcher is not None:
                watcher.stop()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(NotFound(f"No route for {request.method} {request.url.path}."))
        err = InvalidRequest(str(exc.detail), code=f"http_{exc.status_code}")
        err.status_code = exc.status_code
        return error_response(err)


def _add_routes(
    app: FastAPI, fleet: Fleet, keys: KeysFile, metrics: GatewayMetrics, drain: Drain, is_metrics_keyed: bool
) -> None:
    """Every route but the two proxied ones (GatewayApp sends those to the proxy); /metrics wants a
    key only when `is_metrics_keyed` (metrics_require_auth)."""

    def authenticate(request: Request) -> None:
        store = keys.get()
        if store is not None:
            store.authenticate(request.headers)

    def may_see_models(request: Request) -> bool:
        """Whether /health and /ready may name the models: to a caller /v1/models would answer.
        Probes send no key and need only the status code (and `status`)."""
        try:
            authenticate(request)
        except Unauthorized:
            return False
        return True

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authenticate(request)
        return JSONResponse({"object": "list", "data": [fleet.model_entry(m) for m in fleet.listed_models()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> Response:
        authenticate(request)
        if not fleet.has_model(fleet.resolve(model).key):
            raise ModelNotFound(model)
        return JSONResponse(fleet.model_entry(model))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.get("/v1/responses/{response_id}/input_items")
    @app.post("/v1/responses/{response_id}/cancel")
    async def stored_response(response_id: str, request: Request) -> Response:
        authenticate(request)
        message = (
            f"No response `{response_id}`: responses are not stored, so they cannot be retrieved, "
            "listed, cancelled or deleted; send the whole conversation as input."
        )
        raise NotFound(message, param="response_id")

    @app.api_route("/health", methods=["GET", "HEAD"])  # some load balancers probe with HEAD
    async def health(request: Request) -> Response:
        # Liveness (the chart's probe): 200 while the process serves, whatever its replicas do. A
        # model with no healthy replica is named, for people and monitors; restarting the gateway
        # would not bring its replicas back.
        down = fleet.models_down()
        body: dict[str, object] = {"status": "degraded" if down else "ok"}
        if may_see_models(request):
            body.update(models=fleet.models(), models_down=down)
        return JSONResponse(body)

    @app.get("/version")
    async def version() -> Response:
        try:
            return JSONResponse({"version": importlib.metadata.version("corral")})
        except importlib.metadata.PackageNotFoundError:
            return JSONResponse({"version": "0+unknown"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        if drain.is_draining:  # out of the Service's endpoints (the pod's are dropped already)
            return error_response(Draining())
        # Before discovery's first list, every model would look unknown (404): keep traffic away.
        if not fleet.is_synced:
            return error_response(
                Unavailable("Replica discovery has not completed yet.", retry_after_s=1.0, code="not_ready")
            )
        if not may_see_models(request):
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "ready", "models": fleet.models()})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        if is_metrics_keyed:
            authenticate(request)
        fleet.update_gauges()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/corral/replicas")
    async def replicas(request: Request) -> Response:
        authenticate(request)
        return JSONResponse({"time_s": time.monotonic(), "models": fleet.snapshot()})


def _add_adapter_routes(
    app: FastAPI, keys: KeysFile, fanouts: dict[str, AdapterFanout], max_bytes: int
) -> None:
    """vLLM's runtime LoRA routes, sent to every replica of a pool (`adapter_fanout.py`). The
    gateway's keys have no roles: any key its API takes may load and unload adapters."""

    async def fan_out(request: Request, is_load: bool) -> Response:
        store = keys.get()
        if store is not None:
            store.authenticate(request.headers)
        fanout = fanouts.get("fanout")
        if fanout is None:
            raise Unavailable("The gateway is starting.", retry_after_s=1.0, code="not_ready")
        raw = await read_body(request, max_bytes)
        if is_load:
            return await fanout.load(raw, request.headers)
        return await fanout.unload(raw, request.headers)

    @app.post(LOAD_PATH)
    async def load_lora_adapter(request: Request) -> Response:
        return await fan_out(request, is_load=True)

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(request: Request) -> Response:
        return await fan_out(request, is_load=False)
