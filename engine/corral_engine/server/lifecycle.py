"""Serving lifecycle: the periodic throughput log line and SIGTERM drain under uvicorn.

Drain: the first SIGTERM/SIGINT marks the server draining (new requests and /health get 503, so
load balancers stop sending), waits until no generation request is open or the grace period ends
(the requests still open then end with a 503 error, streams with `[DONE]`), then lets uvicorn shut
down; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from corral_engine.http_limits import uvicorn_options
from corral_engine.outputs import EngineStats
from corral_engine.server import errors
from corral_engine.server.context import ServerContext

logger = logging.getLogger(__name__)


def throughput_line(prev: EngineStats, cur: EngineStats, interval_s: float) -> str | None:
    """The log line for one interval, or None when the engine was idle throughout."""
    prompt_tokens = cur.num_prompt_tokens_total - prev.num_prompt_tokens_total
    generation_tokens = cur.num_generation_tokens_total - prev.num_generation_tokens_total
    is_busy = cur.num_running or cur.num_waiting or prev.num_running or prev.num_waiting
    if not (prompt_tokens or generation_tokens or is_busy):
        return None
    queries = cur.num_prefix_cache_queries_total - prev.num_prefix_cache_queries_total
    hits = cur.num_prefix_cache_hits_total - prev.num_prefix_cache_hits_total
    hit_pct = 100.0 * hits / queries if queries else 0.0
    return (
        f"throughput: prompt {prompt_tokens / interval_s:.1f} tok/s, "
        f"generation {generation_tokens / interval_s:.1f} tok/s, running {cur.num_running}, "
        f"waiting {cur.num_waiting}, KV usage {100.0 * cur.kv_usage_ratio:.1f}%, "
        f"prefix cache hits {hit_pct:.1f}%, preemptions {cur.num_preemptions_total}"
    )


async def log_throughput(stats: Callable[[], EngineStats], interval_s: float) -> None:
    prev, prev_t = stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        cur, now = stats(), time.monotonic()
        line = throughput_line(prev, cur, max(now - prev_t, 1e-9))
        if line is not None:
            logger.info(line)
        prev, prev_t = cur, now


class Drain:
    """The drain of one or more servers (a simulated fleet drains all its replicas together):
    begun by the first signal, over once no generation request is open on any of them or when
    the grace period ends."""

    def __init__(self, contexts: list[ServerContext], timeout_s: float) -> None:
        self.contexts = contexts
        self.timeout_s = timeout_s
        self._deadline: float | None = None

    @property
    def is_begun(self) -> bool:
        return self._deadline is not None

    @property
    def num_open(self) -> int:
        return sum(ctx.in_flight.count for ctx in self.contexts)

    def begin(self, sig: int) -> None:
        """New requests and /health get 503 from now on; open ones run on."""
        self._deadline = time.monotonic() + self.timeout_s
        for ctx in self.contexts:
            ctx.is_draining = True
        logger.info("signal %d: draining (%d open requests, grace %.0fs)", sig, self.num_open, self.timeout_s)

    def poll(self) -> bool:
        """Whether the servers may shut down now (logs why); False before `begin`. When the grace
        period ends, the requests still open end with a 503 (`draining`): a stream gets it as an
        error event, then `[DONE]`, instead of being cut when the server stops."""
        if self._deadline is None:
            return False
        if self.num_open == 0:
            logger.info("drained; shutting down")
            return True
        if time.monotonic() >= self._deadline:
            logger.warning("grace period over with %d open requests; aborting them", self.num_open)
            for ctx in self.contexts:
                end_open_streams = getattr(ctx.engine, "end_open_streams", None)
                if end_open_streams is not None:
                    end_open_streams(errors.draining())
            return True
        return False


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain = Drain([ctx], drain_timeout_s)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded for re-raising: a drained engine exits with status 0.
        if self.drain.is_begun:
            logger.warning("second signal %d: exiting now", sig)
            self.should_exit = True
            self.force_exit = True
            return
        self.drain.begin(sig)

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.poll():
            self.should_exit = True
        return await super().on_tick(counter)


def missing_fast_http() -> list[str]:
    """The modules uvicorn would use for a faster event loop and HTTP parser that are not
    installed (it then falls back to asyncio's loop and the pure-Python h11 parser)."""
    return [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is None]


def serve(ctx: ServerContext, app: object, host: str, port: int, drain_timeout_s: float) -> None:
    """Run uvicorn on this thread's event loop until drained."""
    missing = missing_fast_http()
    if missing:
        logger.warning("%s not installed: serving on asyncio's event loop and h11, which stream "
                       "fewer tokens per second (pip install %s)", " and ".join(missing),
                       " ".join(missing))  # fmt: skip
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        log_config=None,  # keep the process's logging setup
        access_log=False,  # handlers log request ids; never prompts
        timeout_graceful_shutdown=2,
        timeout_keep_alive=5,
        **uvicorn_options(),  # a bound on each request's headers
    )
    DrainingServer(config, ctx, drain_timeout_s).run()
