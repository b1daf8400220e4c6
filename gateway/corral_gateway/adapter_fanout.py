"""vLLM's runtime LoRA endpoints on the gateway: a load goes to every ready replica of the base
model's pool (undone everywhere if it fails somewhere), an unload to every replica listing the
adapter, and replicas that become ready later get the adapters loaded this way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from corral_engine import wire
from starlette.responses import PlainTextResponse, Response

from corral_gateway.errors import FanoutFailed, InvalidRequest, ModelNotFound, NotFound, Unavailable
from corral_gateway.fleet import Fleet
from corral_gateway.runtime_adapters import (
    BASE_FIELD,
    LOAD_PATH,
    UNLOAD_PATH,
    AdapterCall,
    Outcome,
    choose_pool,
    failure_message,
    parse_call,
    rollback_plan,
)
from corral_gateway.served_names import parse_model_list
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import Upstream, UpstreamError

logger = logging.getLogger(__name__)

_LIST_TIMEOUT_S = 5.0
_NOT_REACHED = 502  # the status a replica that could not be reached counts as


class AdapterFanout:
    """The gateway's load and unload of LoRA adapters; one call at a time per pool, so a replica
    being given the pool's adapters never races a load or an unload of the same pool."""

    def __init__(self, fleet: Fleet, upstream: Upstream, settings: GatewaySettings) -> None:
        self._fleet = fleet
        self._upstream = upstream
        self._settings = settings
        self._locks: dict[str, asyncio.Lock] = {}
        self._restoring: dict[str, asyncio.Task[None]] = {}  # url -> loading the pool's adapters

    async def load(self, raw: bytes, client: Mapping[str, str]) -> Response:
        """Load on every ready replica of the pool; 200 once all hold it (as vLLM answers)."""
        call = parse_call(raw, is_load=True)
        if self._fleet.is_taken(call.name):
            raise InvalidRequest(
                f"'{call.name}' is a model's name or an alias: the adapter needs a name of its own.",
                param="lora_name",
            )
        if call.base is None:
            pool = choose_pool(self._fleet.lora_pools(), "load")
        else:
            pool = self._pool(call.base)
        elsewhere = [p for p in self._fleet.adapter_pools(call.name) if p != pool]
        if elsewhere:  # its requests would be refused as ambiguous
            raise InvalidRequest(
                f"LoRA adapter '{call.name}' is served for `{elsewhere[0]}`: name this one otherwise.",
                param="lora_name",
            )
        headers = self._headers(client)
        async with self._lock(pool):
            # Ready: in rotation, answering, and its list read (one not yet read gets it then).
            ready = [r.url for r in self._fleet.replicas(pool) if r.served_names is not None
                     and self._fleet.is_healthy(r)]  # fmt: skip
            if not ready:
                raise Unavailable(
                    f"No replica of `{pool}` is ready to load LoRA adapter '{call.name}'; retry later.",
                    retry_after_s=5.0,
                    code="model_unavailable",
                )
            outcomes = list(await asyncio.gather(*(self._load_on(url, call, headers) for url in ready)))
            if not all(o.is_ok for o in outcomes):
                undo = rollback_plan(outcomes)
                undone = [o.url for o in await self._unload_all(undo, call.name, headers) if o.is_ok]
                await self._refresh(undo)
                raise self._failed("load", call.name, pool, outcomes, undone)
            self._fleet.runtime_adapters.remember(pool, call.name, call.body)
            self._fleet.index_adapters()
            await self._refresh(ready)
            logger.info("loaded LoRA adapter %r on %d replicas of %r", call.name, len(ready), pool)
        self._restore_lacking(pool)  # replicas that became ready meanwhile
        return PlainTextResponse(f"Success: LoRA adapter '{call.name}' added successfully.")

    async def unload(self, raw: bytes, client: Mapping[str, str]) -> Response:
        """Unload from every replica of the pool listing it, and stop loading it on new ones."""
        call = parse_call(raw, is_load=False)
        pool = self._pool(call.base) if call.base is not None else self._pool_of(call.name)
        async with self._lock(pool):
            was_loaded = self._fleet.runtime_adapters.forget(pool, call.name)
            if was_loaded:
                self._fleet.index_adapters()
            replicas = self._fleet.replicas(pool)
            listing = [r.url for r in replicas if call.name in r.adapters and r.is_answering]
            if not listing and not was_loaded:
                raise _not_found(call.name)
            outcomes = await self._unload_all(listing, call.name, self._headers(client))
            await self._refresh(listing)
            if not all(o.is_ok for o in outcomes):
                raise self._failed("unload", call.name, pool, outcomes, [])
            logger.info("unloaded LoRA adapter %r from %d replicas of %r", call.name, len(listing), pool)
        return PlainTextResponse(f"Success: LoRA adapter '{call.name}' removed successfully.")

    def restore_soon(self, url: str) -> None:
        """Load on the replica at `url` the adapters loaded through the gateway that it lacks (a
        replica new, restarted or back from an outage); a replica not yet listing one gets none of
        its requests, so they wait for this."""
        task = self._restoring.get(url)
        if task is None or task.done():
            self._restoring[url] = asyncio.create_task(self._restore(url), name=f"adapters {url}")

    async def close(self) -> None:
        for task in self._restoring.values():
            task.cancel()
        for task in self._restoring.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._restoring.clear()

    async def _restore(self, url: str) -> None:
        headers = self._headers({})
        for pool in sorted({r.model for r in self._fleet.replicas_at(url)}):
            async with self._lock(pool):
                replicas = [r for r in self._fleet.replicas_at(url) if r.model == pool]
                listed = {name for r in replicas for name in r.adapters}
                for adapter in self._fleet.runtime_adapters.missing(pool, listed):
                    call = AdapterCall(adapter.name, None, None, adapter.body)
                    outcome = await self._load_on(url, call, headers)
                    if outcome.is_ok:
                        logger.info("loaded LoRA adapter %r on replica %s of %r", adapter.name, url, pool)
                    else:
                        logger.warning("could not load LoRA adapter %r on replica %s of %r (HTTP %d); "
                                       "retried when its model list is next read", adapter.name, url, pool,
                                       outcome.status)  # fmt: skip
                await self._refresh([url])

    def _lock(self, pool: str) -> asyncio.Lock:
        return self._locks.setdefault(pool, asyncio.Lock())

    def _pool(self, base: str) -> str:
        """The pool of the base model a body names."""
        route = self._fleet.resolve(base)
        if route.adapter is not None or not self._fleet.has_model(route.key):
            raise ModelNotFound(base, param=BASE_FIELD)
        return route.key

    def _pool_of(self, name: str) -> str:
        """The pool an adapter to unload is served for, when the body names no base model."""
        pools = self._fleet.adapter_pools(name)
        if not pools:
            raise _not_found(name)
        return choose_pool(pools, f"unload '{name}'")

    def _headers(self, client: Mapping[str, str]) -> dict[str, str]:
        """What the calls to replicas carry: the gateway's key for the engines, else (a gateway
        without keys of its own) the client's, which the engine checks."""
        headers = {"content-type": "application/json"}
        request_id = client.get(wire.HEADER_REQUEST_ID)
        if request_id:
            headers[wire.HEADER_REQUEST_ID] = request_id
        if self._settings.upstream_api_key:
            headers["authorization"] = f"Bearer {self._settings.upstream_api_key}"
        elif self._settings.api_keys_file is None and "authorization" in client:
            headers["authorization"] = client["authorization"]
        return headers

    async def _load_on(self, url: str, call: AdapterCall, headers: dict[str, str]) -> Outcome:
        """Load on one replica: done, already there (vLLM's 400, and the replica lists it), or failed."""
        status, error = await self._post(url + LOAD_PATH, call.body, headers)
        if status == 200:
            return Outcome(url, 200, is_changed=True)
        if status == 400 and call.name in await self._listing(url):
            return Outcome(url, 200)
        return Outcome(url, status, error=error)

    async def _unload_all(self, urls: list[str], name: str, headers: dict[str, str]) -> list[Outcome]:
        body = json.dumps({"lora_name": name}).encode()

        async def unload_on(url: str) -> Outcome:
            status, error = await self._post(url + UNLOAD_PATH, body, headers)
            if status in (200, 404):  # 404: gone already
                return Outcome(url, 200, is_changed=status == 200)
            logger.warning("could not unload LoRA adapter %r from replica %s (HTTP %d)", name, url, status)
            return Outcome(url, status, error=error)

        return list(await asyncio.gather(*(unload_on(url) for url in urls)))

    async def _post(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, Any] | None]:
        """POST and read the answer: its status and its OpenAI error object, if it has one."""
        try:
            response = await self._upstream.post(url, body, headers, is_stream=False)
        except UpstreamError as e:
            return _NOT_REACHED, {"message": f"not reached: {e}"}
        is_read = False
        try:
            content = await response.read()
            is_read = True
        except UpstreamError as e:
            return _NOT_REACHED, {"message": f"answer broke off: {e}"}
        finally:
            response.close(is_read)
        if response.status_code == 200:
            return 200, None
        return response.status_code, _error_of(content)

    async def _listing(self, url: str) -> dict[str, dict[str, Any]]:
        """The replica's /v1/models (id -> fields); empty when it cannot be read."""
        key = self._settings.upstream_api_key
        headers = {"authorization": f"Bearer {key}"} if key else None
        try:
            fetched = await self._upstream.get(url + "/v1/models", _LIST_TIMEOUT_S, headers)
        except UpstreamError:
            return {}
        return (parse_model_list(fetched.body) if fetched.status == 200 else None) or {}

    async def _refresh(self, urls: list[str]) -> None:
        """Read the replicas' lists now, so routing follows the call at once (not a poll later)."""
        listings = await asyncio.gather(*(self._listing(url) for url in urls))
        for url, listed in zip(urls, listings, strict=True):
            if listed:
                self._fleet.observe_served_names(url, listed)

    def _restore_lacking(self, pool: str) -> None:
        runtime = self._fleet.runtime_adapters
        for replica in self._fleet.replicas(pool):
            if replica.served_names is not None and runtime.missing(pool, replica.adapters):
                self.restore_soon(replica.url)

    @staticmethod
    def _failed(verb: str, name: str, pool: str, outcomes: list[Outcome], undone: list[str]) -> FanoutFailed:
        first = next(o for o in outcomes if not o.is_ok)
        upstream = dict(first.error) if first.error is not None else None
        return FanoutFailed(failure_message(verb, name, pool, outcomes, undone), first.status, upstream)


def _not_found(name: str) -> NotFound:
    """The engine's answer to unloading an adapter it does not serve."""
    return NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found")


def _error_of(content: bytes) -> dict[str, Any] | None:
    """The OpenAI error object of an error answer, or its text as the message."""
    try:
        body = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        text = content.decode("utf-8", "replace").strip()
        return {"message": text[:200]} if text else None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error
    if isinstance(body, dict) and isinstance(body.get("message"), str):  # vLLM's top-level error shape
        return {k: body[k] for k in ("message", "type", "param") if k in body}
    return None
