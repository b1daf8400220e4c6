"""Drive a benchmark run: check the endpoint, send requests on their arrival schedule, scrape /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import aiohttp
from corral_engine.wire import NUM_PREEMPTIONS_TOTAL

from corral_cli.bench import prom
from corral_cli.bench.arrivals import arrival_offsets_s
from corral_cli.bench.client import RequestSettings, error_message, send_request
from corral_cli.bench.pooling import POOLING_ENDPOINTS, PoolingRequest, send_pooling_request
from corral_cli.bench.stats import RequestResult, aggregate
from corral_cli.bench.workload import BenchRequest

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 10.0
T = TypeVar("T")
# A generation request (completions, chat) or an embeddings / rerank one, as the endpoint type says.
AnyRequest: TypeAlias = BenchRequest | PoolingRequest


class BenchError(Exception):
    """A problem the user must fix (unreachable endpoint, bad dataset, ...); reported without a trace."""


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a load generator's coroutine to the end on uvloop where it is installed (a sixth less of
    the client's CPU per streamed token than asyncio's own loop, measured; docs/bench.md), else on
    asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@dataclass(frozen=True, slots=True)
class RunSettings:
    request_rate: float  # requests/s; inf sends everything at once
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    metrics_url: str | None = None  # None: no /metrics scrape
    show_progress: bool = True


@dataclass(slots=True)
class RunOutcome:
    summary: dict[str, Any]
    results: list[RequestResult]


# Lines up to this long (an SSE event with many logprobs, say) are read whole.
_MAX_LINE_BYTES = 2**20


def make_client(request_timeout_s: float, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """The benchmark's HTTP client; open it with `async with` inside the event loop.

    No connection cap: a client-side pool limit would queue requests and inflate TTFT. The timeout
    is per read (a stream may run long, but not go silent), as a user's client would set it."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CHECK_TIMEOUT_S, sock_read=request_timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        trust_env=False,
        read_bufsize=_MAX_LINE_BYTES,
        headers=headers,
    )


async def _get_text(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url, timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)) as response:
        return response.status, await response.text(errors="replace")


@dataclass(frozen=True, slots=True)
class ModelList:
    """What /v1/models answered: the served model ids, or why there are none to read."""

    models: list[str]
    problem: str | None = None  # e.g. "HTTP 401: invalid API key", with a hint where one helps


def base_url_hint(base_url: str, status: int) -> str:
    """A hint for a 404 on a base URL that already ends in /v1 (its paths get a second /v1)."""
    if status == 404 and base_url.rstrip("/").endswith("/v1"):
        return f" (the base URL is the server root: drop the trailing /v1 from {base_url})"
    return ""


async def list_models(client: aiohttp.ClientSession, base_url: str) -> ModelList:
    """The model ids the endpoint serves, or the problem its /v1/models answered; BenchError if
    unreachable."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        status, text = await _get_text(client, url)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise BenchError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from e
    if status != 200:
        return ModelList([], error_message(status, text.encode()) + base_url_hint(base_url, status))
    try:
        return ModelList([str(m["id"]) for m in json.loads(text).get("data", [])])
    except (ValueError, KeyError, TypeError, AttributeError):
        return ModelList([], f"the answer is not an OpenAI model list: {text[:200]!r}")


@dataclass(frozen=True, slots=True)
class Scrape:
    """A counter read from a metrics endpoint: its value, or why there is none (for the report)."""

    value: float | None
    problem: str | None = None


async def scrape_counter(client: aiohttp.ClientSession, metrics_url: str | None, name: str) -> Scrape:
    if metrics_url is None:
        return Scrape(None, "not scraped (--no-metrics)")
    try:
        status, text = await _get_text(client, metrics_url)
    except (aiohttp.ClientError, TimeoutError) as e:
        log.warning("cannot scrape %s: %s: %s", metrics_url, type(e).__name__, e)
        return Scrape(None, f"cannot scrape {metrics_url}: {type(e).__name__}")
    if status != 200:
        return Scrape(None, f"{metrics_url} answered HTTP {status}")
    value = prom.sum_samples(text, name)
    if value is None:
        # A gateway's /metrics: its own series, not its engines' counters.
        return Scrape(
            None, f"{metrics_url} has no {name} (a gateway? --metrics-url ENGINE/metrics counts one engine's)"
        )
    return Scrape(value)


def _delta(before: Scrape, after: Scrape) -> tuple[float | None, str | None]:
    """A counter's increase over a run, or why it is unknown."""
    problem = before.problem or after.problem
    if problem is not None:
        return None, problem
    increase = prom.delta(before.value, after.value)
    return (increase, None) if increase is not None else (None, "the counter went down (a server restarted?)")


async def _send(
    client: aiohttp.ClientSession, settings: RequestSettings, request: AnyRequest
) -> RequestResult:
    if isinstance(request, PoolingRequest):
        return await send_pooling_request(client, settings, request)
    return await send_request(client, settings, request)


def is_generation(endpoint_type: str) -> bool:
    """Whether the endpoint generates tokens (completions, chat), not vectors or scores."""
    return endpoint_type not in POOLING_ENDPOINTS


async def run_once(
    client: aiohttp.ClientSession, request: RequestSettings, run: RunSettings, requests: Sequence[AnyRequest]
) -> RunOutcome:
    """Send `requests` on a seeded arrival schedule and summarise what came back."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    offsets = arrival_offsets_s(len(requests), run.request_rate, run.burstiness, run.seed)
    slots = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else None
    preemptions_before = await scrape_counter(client, run.metrics_url, NUM_PREEMPTIONS_TOTAL)
    rate = "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"
    progress = Progress(
        TextColumn(f"rate {rate} req/s"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not run.show_progress,
        transient=True,
    )
    task = progress.add_task("requests", total=len(requests))

    async def one(bench_request: AnyRequest) -> RequestResult:
        if slots is None:
            result = await _send(client, request, bench_request)
        else:
            async with slots:
                result = await _send(client, request, bench_request)
        progress.advance(task)
        return result

    with progress:
        start, cpu_start = time.perf_counter(), time.process_time()
        tasks = []
        for offset_s, bench_request in zip(offsets, requests, strict=True):
            delay_s = start + offset_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.create_task(one(bench_request)))
        results = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - start
        client_cpu_s = time.process_time() - cpu_start
    preemptions_after = await scrape_counter(client, run.metrics_url, NUM_PREEMPTIONS_TOTAL)
    num_preemptions, preemptions_unknown_why = _delta(preemptions_before, preemptions_after)

    summary = {
        "endpoint_type": request.endpoint_type,
        "request_rate": run.request_rate,
        "burstiness": run.burstiness,
        "max_concurrency": run.max_concurrency,
        "num_prompts": len(requests),
        **aggregate(results, duration_s, is_generation(request.endpoint_type)),
        "num_preemptions": _as_count(num_preemptions),
        "preemptions_unknown_why": preemptions_unknown_why,  # None when counted
        # The load generator's own CPU over the run: on a machine it shares with the server, what
        # it took from the server's cores (per output token in the report).
        "client_cpu_s": client_cpu_s,
    }
    return RunOutcome(summary, results)


def _as_count(value: float | None) -> int | float | None:
    return int(value) if value is not None and value.is_integer() else value


async def warm_up(
    client: aiohttp.ClientSession,
    request: RequestSettings,
    requests: Sequence[AnyRequest],
    max_concurrency: int | None = None,
) -> None:
    """Send `requests` at once (at most `max_concurrency` in flight) and wait for them all; what
    they measure is dropped. They open the client's connections and take a fresh server's first
    costs (its first batches, caches, lazily built state) before any run's clock starts."""
    if not requests:
        return
    slots = asyncio.Semaphore(max_concurrency or len(requests))

    async def one(bench_request: AnyRequest) -> RequestResult:
        async with slots:
            return await _send(client, request, bench_request)

    results = await asyncio.gather(*(one(r) for r in requests))
    failed = [r.error for r in results if not r.is_success]
    log.info("warm-up: %d requests, %d failed", len(results), len(failed))
    if failed:
        log.warning("warm-up: %d of %d requests failed, e.g. %s", len(failed), len(results), failed[0])


async def run_sweep(
    request: RequestSettings,
    runs: Sequence[tuple[RunSettings, Sequence[AnyRequest]]],
    request_timeout_s: float,
    warmup: Sequence[AnyRequest] | None = None,
    warmup_max_concurrency: int | None = None,
) -> list[RunOutcome]:
    """Send the warm-up's requests, then run each (setting, workload) in turn, one after the other,
    on the same client (the warm-up's connections kept)."""
    async with make_client(request_timeout_s, request.headers) as client:
        await warm_up(client, request, warmup or [], warmup_max_concurrency)
        return [await run_once(client, request, run, requests) for run, requests in runs]


async def resolve_model(base_url: str, model: str | None, headers: dict[str, str] | None = None) -> str:
    """`model` if given, else the endpoint's first served model; BenchError if unreachable or none.

    With `model` given, a models list the endpoint refuses is only a warning: some servers have none.
    """
    async with make_client(CHECK_TIMEOUT_S, headers) as client:
        listed = await list_models(client, base_url)
    where = base_url.rstrip("/") + "/v1/models"
    if model:
        if listed.problem:
            log.warning("%s answered %s", where, listed.problem)
        elif listed.models and model not in listed.models:
            log.warning("model %r is not among the served models %s", model, listed.models)
        return model
    if listed.problem:
        raise BenchError(f"{where} answered {listed.problem}")
    if not listed.models:
        raise BenchError(f"{base_url} lists no models; pass --model")
    return listed.models[0]
