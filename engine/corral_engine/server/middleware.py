"""The outermost ASGI layer: load headers (and, with LoRA, the adapters' version) on every response,
API-key auth, last-resort errors, and the request id and access log line of every /v1 request (and
of a failed probe or scrape).

Pure ASGI (not BaseHTTPMiddleware) so streaming bodies and client disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import logging
import time

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral_engine import wire
from corral_engine.server import access, errors
from corral_engine.server.context import ServerContext
from corral_engine.server.metrics import RejectionReason

logger = logging.getLogger(__name__)

# Paths anyone may read even when an API key is set (probes and scrapers carry no key).
PUBLIC_PATHS = frozenset({"/health", "/metrics"})
# Refused API requests by status, for corral_engine_requests_rejected_total{reason}.
REJECTION_REASON_BY_STATUS: dict[int, RejectionReason] = {
    400: "invalid",
    401: "unauthorized",
    404: "unknown_model",
    413: "invalid",
    429: "queue_full",
    503: "unavailable",
}

# vLLM's score and rerank routes outside /v1: requests of the model, with ids and access lines too.
_SCORE_PATHS = frozenset({"/score", "/rerank", "/v2/rerank"})


class ServerMiddleware:
    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        self._api_key = ctx.api_key.encode() if ctx.api_key else None

    def _is_authorized(self, scope: Scope) -> bool:
        if self._api_key is None or scope.get("path", "") in PUBLIC_PATHS:
            return True
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key)

    def _load_headers(self, message: Message) -> None:
        """The engine's load as of its last step, where the response has not said it already: a
        429 from a full queue counts the requests it was refused behind, those sent to the step
        loop since that step included (which the last step's count reads as 0)."""
        stats = self.ctx.engine.stats()
        headers = MutableHeaders(scope=message)
        headers.setdefault(wire.HEADER_NUM_RUNNING, str(stats.num_running))
        headers.setdefault(wire.HEADER_NUM_WAITING, str(stats.num_waiting))
        headers.setdefault(wire.HEADER_KV_USAGE, f"{stats.kv_usage_ratio:.4f}")
        if self.ctx.is_lora_enabled:  # a gateway re-reads /v1/models when it changes
            headers.setdefault(wire.HEADER_MODELS_VERSION, self.ctx.adapters.version)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        path: str = scope["path"]
        record = None
        is_api = path.startswith("/v1/") or path in _SCORE_PATHS
        if is_api:
            server = scope.get("server")  # (address, port) of the socket it came in on
            record = access.begin(Headers(scope=scope), scope["method"], path, self.ctx.model_name, server)
        elif access.is_probe(scope["method"], path):
            # Its line only, should it fail: no id, span or context for /health and /metrics.
            record = access.AccessRecord(None, time.monotonic())

        async def send_with_load(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._load_headers(message)
                if record is not None:
                    record.status = message["status"]
                    if is_api:
                        MutableHeaders(scope=message)[wire.HEADER_REQUEST_ID] = record.ensure_id()
                reason = REJECTION_REASON_BY_STATUS.get(message["status"])
                if reason is not None and scope["method"] == "POST" and is_api:
                    self.ctx.metrics.count_rejected(reason)
            await send(message)

        try:
            if not self._is_authorized(scope):
                await errors.error_response(errors.unauthorized())(scope, receive, send_with_load)
                return
            await self.app(scope, receive, send_with_load)
        except Exception as e:
            if started:
                access.log_for_request(logger, logging.ERROR, "error after the response started", exc_info=e)
                return
            await errors.error_response(e)(scope, receive, send_with_load)
        finally:
            if record is not None:
                access.log_request(
                    record, scope["method"], path, self.ctx.model_name, self.ctx.log_probe_requests
                )
