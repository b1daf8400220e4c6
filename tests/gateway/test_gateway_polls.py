"""When the gateway polls a replica for its load (only when no response brought it recently), and
what an unanswered poll means."""

from __future__ import annotations

import asyncio
import contextlib
from typing import cast

from corral_engine import wire
from corral_gateway.fleet import Fleet
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import Fetched, ReadTimedOut, Upstream

HEADERS = {wire.HEADER_NUM_RUNNING: "2", wire.HEADER_NUM_WAITING: "0", wire.HEADER_KV_USAGE: "0.1"}


def test_a_replica_whose_responses_carry_its_load_is_not_polled() -> None:
    now = [100.0]
    settings = GatewaySettings(backends={"m": ["http://a", "http://b"]}, poll_interval_s=0.075)
    fleet = Fleet(settings, GatewayMetrics(), clock=lambda: now[0])
    assert fleet.pollers.is_due_for_load_poll("http://a")  # nothing known yet
    fleet.observe_headers("http://a", HEADERS)  # a response's load headers
    now[0] += 0.05
    assert not fleet.pollers.is_due_for_load_poll("http://a")
    assert fleet.pollers.is_due_for_load_poll("http://b")
    now[0] += 0.03  # the sample is now older than a poll interval
    assert fleet.pollers.is_due_for_load_poll("http://a")


async def test_stopping_the_pollers_outlasts_a_lost_cancel() -> None:
    # Python 3.11's asyncio.wait_for could lose a cancel that landed as a connect failed; a poller
    # that lost one polled on, and the gateway never stopped.
    from corral_gateway.replica_poller import _stop_all

    async def loses_one_cancel() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # lost, as inside wait_for
            await asyncio.sleep(60)
        await asyncio.sleep(60)

    task = asyncio.create_task(loses_one_cancel())
    await asyncio.sleep(0)
    await asyncio.wait_for(_stop_all([task]), 10)
    assert task.cancelled()


class _Unanswered:
    """An upstream whose every GET times out, as a stopped replica's or a very busy one's."""

    async def get(self, url: str, timeout_s: float, headers: object = None) -> Fetched:
        raise ReadTimedOut("TimeoutError")


def _failures(fleet: Fleet, url: str) -> int:
    return next(int(str(r["num_consecutive_failures"])) for r in fleet.snapshot()["m"] if r["url"] == url)


async def test_an_unanswered_health_poll_counts_only_while_the_replica_is_silent() -> None:
    """A busy engine may answer /health late while its streams flow: not a failure. One that
    has sent nothing at all for a while (stopped, wedged) fails its polls until it is ejected."""
    now = [100.0]
    settings = GatewaySettings(backends={"m": ["http://a", "http://b"]}, eject_after_failures=2)
    fleet = Fleet(settings, GatewayMetrics(), clock=lambda: now[0])
    upstream = cast(Upstream, _Unanswered())
    fleet.observe_headers("http://a", HEADERS)
    for _ in range(5):  # its streams' chunks keep coming
        now[0] += 1.0
        fleet._registry.by_url("http://a")[0].step_phase.on_chunk(now[0])
        assert await fleet.pollers._poll_get(upstream, "http://a", "/health") is None
    assert _failures(fleet, "http://a") == 0
    now[0] += 3.5  # then nothing
    await fleet.pollers._poll_get(upstream, "http://a", "/health")
    await fleet.pollers._poll_get(upstream, "http://a", "/health")
    assert next(r for r in fleet.snapshot()["m"] if r["url"] == "http://a")["ejected"] is True
    await fleet.pollers._poll_get(upstream, "http://b", "/metrics")  # a slow /metrics page is load
    assert _failures(fleet, "http://b") == 0
