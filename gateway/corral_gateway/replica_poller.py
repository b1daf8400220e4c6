"""Per-replica polling: one task per replica URL samples its load (/health load headers, else
/metrics), probes it while ejected, and reads its model list and LoRA state when due, or as soon
as the models version its responses carry changes."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from corral_engine import wire

from corral_gateway.health_probe import HealthProbe
from corral_gateway.load import LoraState, parse_load_headers, parse_lora_info, parse_metrics_text
from corral_gateway.registry import Registry
from corral_gateway.served_names import parse_model_list
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import (
    ConnectFailed,
    ConnectTimedOut,
    Fetched,
    ReadTimedOut,
    Upstream,
    UpstreamError,
)

logger = logging.getLogger(__name__)

_STOP_RECHECK_S = 0.5  # how long a cancelled poller may take before it is cancelled again
_POLL_READ_TIMEOUT_S = 1.0
# A /health poll unanswered counts as a failure once the replica has sent nothing for this long: a
# busy engine's answers and streams still come, a stopped one's do not.
_SILENT_S = 3.0
# A replica's model list is read on first contact, after each outage (the address may now hold
# another engine), as soon as its models version header changes (a Corral engine with LoRA on: an
# adapter was loaded or unloaded) and, as a fallback (vLLM sends no such header), at this interval.
_NAMES_CHECK_INTERVAL_S = 60.0
# A replica serving LoRA adapters (it lists one, or reports their state) is asked more often: adapters
# are loaded and unloaded at runtime. An engine that sends load headers (Corral's) is not polled on
# /metrics, so the adapter state of one that lists adapters is read then too (one /metrics render
# every 2 s, not 13 a second); between reads, the adapter requests this gateway has in flight there
# say where an adapter is active.
_ADAPTERS_CHECK_INTERVAL_S = 2.0


class PollSink(Protocol):
    """What the pollers report to (the Fleet)."""

    def record_failure(self, url: str, reason: str) -> None: ...

    def is_loop_stalled(self) -> bool: ...

    def observe_served_names(self, url: str, listed: Mapping[str, dict[str, Any]]) -> None: ...

    def observe_lora(self, url: str, lora: LoraState) -> None: ...


@dataclass(slots=True)
class _Watch:
    """When to read one replica's model list next, and the models version it last said."""

    # -inf: at once; +inf: a read is under way (a version change meanwhile makes it -inf again).
    names_due_s: float
    models_version: str | None = None


class ReplicaPollers:
    """One polling task per replica URL (`sync` starts and stops them), feeding `sink`; `pump` runs
    after each turn, so queued requests move as load is learnt."""

    def __init__(
        self,
        registry: Registry,
        settings: GatewaySettings,
        clock: Callable[[], float],
        sink: PollSink,
        pump: Callable[[], None],
    ) -> None:
        self._registry = registry
        self.settings = settings
        self.clock = clock
        self._sink = sink
        self._pump = pump
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watches: dict[str, _Watch] = {}
        self._metrics_only: set[str] = set()  # replicas without load headers (vLLM): poll /metrics

    def sync(self, upstream: Upstream, urls: Collection[str]) -> None:
        """A poller for each of `urls`, none for any other."""
        for url in set(urls) - set(self._tasks):
            self._watches[url] = _Watch(names_due_s=self.clock())
            self._tasks[url] = asyncio.create_task(self._poll_loop(upstream, url), name=f"poll {url}")
        for url in set(self._tasks) - set(urls):
            self._tasks.pop(url).cancel()
            # The address may next belong to another engine.
            self._metrics_only.discard(url)
            self._watches.pop(url, None)

    async def stop(self) -> None:
        await _stop_all(self._tasks.values())
        self._tasks.clear()
        self._watches.clear()

    def observe_headers(self, url: str, headers: Mapping[str, str]) -> None:
        """A new models version from the replica (any response's headers): read its list now."""
        version = headers.get(wire.HEADER_MODELS_VERSION)
        watch = self._watches.get(url)
        if version is None or watch is None or version == watch.models_version:
            return
        if watch.models_version is not None:
            logger.debug("replica %s: models version %s -> %s", url, watch.models_version, version)
        watch.models_version = version
        watch.names_due_s = -math.inf

    async def _poll_loop(self, upstream: Upstream, url: str) -> None:
        probe = HealthProbe(url) if url.startswith("http://") else None
        watch = self._watches[url]
        try:
            while True:
                is_healthy: bool | None = None  # None: not asked this turn
                if any(r.is_ejected for r in self._registry.by_url(url)):
                    if self._registry.is_due_for_probe(url, self.clock()):
                        is_healthy = await self._probe(upstream, url)
                elif self.is_due_for_load_poll(url):
                    is_healthy = await self._poll_load(upstream, url, probe)
                else:
                    is_healthy = True  # a response brought its load within the interval
                if is_healthy is False:
                    watch.names_due_s = self.clock()  # it may come back as another engine: ask then
                elif is_healthy and self.clock() >= watch.names_due_s:
                    await self._read_names(upstream, url, watch)
                self._pump()
                await asyncio.sleep(self.settings.poll_interval_s)
        finally:
            if probe is not None:
                probe.close()

    async def _read_names(self, upstream: Upstream, url: str, watch: _Watch) -> None:
        """Read the model list now and say when next: sooner while adapters are served there, on
        the next turn when unreachable or when the models version changed during the read."""
        watch.names_due_s = math.inf
        is_read = await self._check_names(upstream, url, watch)
        if watch.names_due_s != math.inf:
            return  # a new version came meanwhile: read again
        if not is_read:
            watch.names_due_s = self.clock()
            return
        interval_s = _ADAPTERS_CHECK_INTERVAL_S if self.is_serving_adapters(url) else _NAMES_CHECK_INTERVAL_S
        watch.names_due_s = self.clock() + interval_s

    def is_serving_adapters(self, url: str) -> bool:
        """Whether the replica lists adapters or reports their state (LoRA is on there)."""
        return any(r.adapters or r.lora is not None for r in self._registry.by_url(url))

    def is_lora_enabled(self, url: str) -> bool:
        """Whether the replica serves LoRA: it sends a models version (a Corral engine with LoRA
        on), lists adapters or reports their state."""
        watch = self._watches.get(url)
        return (watch is not None and watch.models_version is not None) or self.is_serving_adapters(url)

    def is_due_for_load_poll(self, url: str) -> bool:
        """Whether the replica's load is older than a poll interval. Every response brings its
        load headers, so a replica answering requests needs no poll; one poll costs the gateway
        ~0.4 ms of CPU, which at 13 polls a second per replica took 0.1 cores for 16 replicas
        whether or not they had traffic."""
        now_s, interval_s = self.clock(), self.settings.poll_interval_s
        return not any(
            r.sample is not None and now_s - r.sample.at_s < interval_s for r in self._registry.by_url(url)
        )

    async def _poll_load(self, upstream: Upstream, url: str, probe: HealthProbe | None = None) -> bool:
        """One load sample: from the load headers on a GET /health where the engine sends them
        (Corral's engine does, on every response), else from /metrics (vLLM's names; vLLM itself).
        Rendering and parsing a /metrics page, histograms and all, ten times a second costs the
        engine and the gateway CPU that on a shared node comes out of serving.

        Returns whether the replica answered healthy. A 5xx /health (an engine starting, draining,
        or whose loop died) counts as a failure, as a refused connection does."""
        if url not in self._metrics_only:
            fetched = await self._poll_get(upstream, url, "/health", probe)
            if fetched is None:
                return False
            sample = parse_load_headers(fetched.headers, self.clock())
            if sample is not None:
                self._registry.observe(url, sample)
            self.observe_headers(url, fetched.headers)
            if fetched.status >= 500:
                self._sink.record_failure(url, f"load poll: /health answered {fetched.status}")
                return False
            if sample is not None:
                return self._poll_succeeded(url, fetched.status)
            if fetched.status == 200:
                self._metrics_only.add(url)  # healthy, but says nothing about its load
        fetched = await self._poll_get(upstream, url, "/metrics")
        if fetched is None:
            return False
        if fetched.status == 200:
            text = fetched.body.decode("utf-8", "replace")
            sample = parse_metrics_text(text, self.clock())
            if sample is not None:
                self._registry.observe(url, sample)
            lora = parse_lora_info(text)
            if lora is not None:
                self._sink.observe_lora(url, lora)
        return self._poll_succeeded(url, fetched.status)

    def is_silent(self, url: str) -> bool:
        """Whether nothing has come from the replica for `_SILENT_S`: no response's load headers,
        no answered poll, no streamed chunk."""
        heard_s = -math.inf
        for replica in self._registry.by_url(url):
            if replica.sample is not None:
                heard_s = max(heard_s, replica.sample.at_s)
            heard_s = max(heard_s, replica.step_phase.last_chunk_s)
        return self.clock() - heard_s > _SILENT_S

    def _poll_succeeded(self, url: str, status: int) -> bool:
        if status != 200:
            return False
        for replica in self._registry.poll_succeeded(url):
            logger.info("replica %s of model %s answers again", url, replica.model)
        return True

    async def _poll_get(
        self, upstream: Upstream, url: str, path: str, probe: HealthProbe | None = None
    ) -> Fetched | None:
        try:
            if probe is not None:
                return await probe.get(_POLL_READ_TIMEOUT_S, self.settings.connect_timeout_s)
            return await upstream.get(url + path, _POLL_READ_TIMEOUT_S)
        except ConnectTimedOut as e:
            if self._sink.is_loop_stalled():  # the gateway's own stall: no verdict on the replica
                logger.debug("load poll of %s%s: connect timed out while the loop stalled", url, path)
                return None
            self._sink.record_failure(url, f"load poll: {e}")
        except ConnectFailed as e:
            self._sink.record_failure(url, f"load poll: {e}")
        except ReadTimedOut as e:
            if path == "/health" and self.is_silent(url):
                # Nothing from the replica at all, its streams included: a stopped or wedged process,
                # whose kernel still takes connections, so nothing else notices. Counted like a
                # failed request, so a run of them ejects it; a response to a request clears it.
                self._sink.record_failure(url, f"load poll: no answer for {_SILENT_S:g} s")
                return None
            # A busy server may answer slowly while its streams flow: load, not a failure.
            logger.debug("load poll of %s%s failed: %s", url, path, e)
        except UpstreamError as e:
            logger.debug("load poll of %s%s failed: %s", url, path, e)
        return None

    async def _probe(self, upstream: Upstream, url: str) -> bool:
        try:
            is_healthy = (await upstream.get(f"{url}/health", _POLL_READ_TIMEOUT_S)).status == 200
        except ConnectTimedOut:
            if self._sink.is_loop_stalled():  # no verdict: probed again on the next turn
                return False
            is_healthy = False
        except UpstreamError:
            is_healthy = False
        if is_healthy:
            if self._registry.readmit(url):
                logger.info("replica %s is healthy again; back in rotation", url)
        else:
            self._registry.probe_failed(url, self.clock())
        return is_healthy

    async def _check_names(self, upstream: Upstream, url: str, watch: _Watch) -> bool:
        """Read the names the replica serves (its /v1/models). Returns False when the replica could
        not be reached (ask again on the next turn); an answer that lists nothing (say, 401: the
        engine wants a key the gateway lacks) leaves its names unknown."""
        key = self.settings.upstream_api_key
        headers = {"authorization": f"Bearer {key}"} if key else None
        try:
            fetched = await upstream.get(url + "/v1/models", _POLL_READ_TIMEOUT_S, headers)
        except (ConnectFailed, ConnectTimedOut):
            return False
        except UpstreamError as e:
            logger.debug("model list of %s not read: %s", url, e)
            return True
        listed = parse_model_list(fetched.body) if fetched.status == 200 else None
        if listed is None:
            logger.debug("model list of %s not read: HTTP %d", url, fetched.status)
            return True
        # The list read is of this version: no need to read it again when a response says it.
        watch.models_version = fetched.headers.get(wire.HEADER_MODELS_VERSION, watch.models_version)
        self._sink.observe_served_names(url, listed)
        if url not in self._metrics_only and any(r.adapters for r in self._registry.by_url(url)):
            await self._check_lora(upstream, url)  # its load polls do not read /metrics
        return True

    async def _check_lora(self, upstream: Upstream, url: str) -> None:
        """Read the replica's LoRA state from its /metrics (an engine that sends load headers)."""
        try:
            fetched = await upstream.get(url + "/metrics", _POLL_READ_TIMEOUT_S)
        except UpstreamError as e:
            logger.debug("LoRA state of %s not read: %s", url, e)
            return
        lora = parse_lora_info(fetched.body.decode("utf-8", "replace")) if fetched.status == 200 else None
        if lora is not None:
            self._sink.observe_lora(url, lora)


async def _stop_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait for them, cancelling again any that lost a cancel (a library
    call that swallows one: see `HealthProbe`), so a gateway told to stop always stops."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_STOP_RECHECK_S)
