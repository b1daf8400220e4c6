"""The gateway's stop on SIGTERM, as the engine's: keep listening but refuse new requests (503
`draining`, `/ready` 503), fail queued ones at once, let the ones at replicas finish up to
`drain_timeout_s`, then end those still open with an OpenAI-shaped error (a stream: an error event,
then `[DONE]`) before the server closes, rather than have the pod's SIGKILL cut them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn

logger = logging.getLogger(__name__)


class Drain:
    """The open proxied requests and, once begun, the deadline they have. Each open request is
    represented by its `ended` future (the proxy's hang-up future), which the deadline completes:
    every wait of the proxy already ends on it, and `is_over` tells that apart from a hang-up."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.on_begin: list[Callable[[], None]] = []  # e.g. failing the queued requests
        self.is_over = False  # the deadline passed: the requests still open are being ended
        self._deadline: float | None = None
        self._open: set[asyncio.Future[None]] = set()

    @property
    def is_draining(self) -> bool:
        return self._deadline is not None

    @property
    def num_open(self) -> int:
        return len(self._open)

    def begin(self) -> None:
        self._deadline = self.clock() + self.timeout_s
        logger.info("draining: %d open requests, %.0f s to finish", self.num_open, self.timeout_s)
        for callback in self.on_begin:
            callback()

    def end_now(self) -> None:
        """The deadline is now: the next `poll` ends the requests still open."""
        self._deadline = self.clock()

    @contextmanager
    def tracking(self, ended: asyncio.Future[None]) -> Iterator[None]:
        """Count a proxied request as open for the block; `ended` completes if the drain's time
        runs out first."""
        self._open.add(ended)
        try:
            yield
        finally:
            self._open.discard(ended)

    def poll(self) -> bool:
        """Whether the server may stop now: nothing open, or the deadline passed (the requests
        still open are ended then, and finish their answers while the server closes)."""
        if self._deadline is None:
            return False
        if not self._open:
            logger.info("drained; stopping")
            return True
        if self.clock() < self._deadline:
            return False
        logger.warning("drain timeout: ending %d open requests", self.num_open)
        self.is_over = True
        for ended in list(self._open):
            if not ended.done():
                ended.set_result(None)
        return True


# How long the server waits, once it stops, for the answers ended at the deadline to be written.
GRACEFUL_CLOSE_S = 3


class DrainingServer(uvicorn.Server):
    """uvicorn, with the first SIGTERM or SIGINT beginning a `Drain` instead of closing the
    listener (a client the Service still sends to gets a 503 it may retry, not a refused
    connection). A second signal (Ctrl-C twice) ends the open requests at once, with the same
    error, and stops as a drain does: uvicorn's forced exit would cut streams mid-event and skip
    the app's shutdown (tracebacks from the tasks it leaves). A third one forces the exit."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.num_signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Counted, not read from the drain: a drain with nothing open is over at once, and the
        # second Ctrl-C of a double press must not force the exit then.
        self.num_signals += 1
        if self.num_signals == 1:
            self.drain.begin()
        elif self.num_signals == 2:
            logger.warning("second signal %d: ending %d open requests now", sig, self.drain.num_open)
            self.drain.end_now()
        else:
            logger.warning("signal %d while stopping: exiting now", sig)
            self.should_exit = True
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.poll():
            self.should_exit = True
        return await super().on_tick(counter)
