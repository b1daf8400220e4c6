"""When the gateway polls a replica for its load: only when no response brought it recently."""

from __future__ import annotations

import asyncio
import contextlib

from corral_engine import wire
from corral_gateway.fleet import Fleet
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.settings import GatewaySettings

HEADERS = {wire.HEADER_NUM_RUNNING: "2", wire.HEADER_NUM_WAITING: "0", wire.HEADER_KV_USAGE: "0.1"}


def test_a_replica_whose_responses_carry_its_load_is_not_polled() -> None:
    now = [100.0]
    settings = GatewaySettings(backends={"m": ["http://a", "http://b"]}, poll_interval_s=0.075)
    fleet = Fleet(settings, GatewayMetrics(), clock=lambda: now[0])
    assert fleet.is_due_for_load_poll("http://a")  # nothing known yet
    fleet.observe_headers("http://a", HEADERS)  # a response's load headers
    now[0] += 0.05
    assert not fleet.is_due_for_load_poll("http://a")
    assert fleet.is_due_for_load_poll("http://b")
    now[0] += 0.03  # the sample is now older than a poll interval
    assert fleet.is_due_for_load_poll("http://a")


async def test_stopping_the_pollers_outlasts_a_lost_cancel() -> None:
    # Python 3.11's asyncio.wait_for could lose a cancel that landed as a connect failed; a poller
    # that lost one polled on, and the gateway never stopped.
    from corral_gateway.fleet import _stop_all

    async def loses_one_cancel() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # lost, as inside wait_for
            await asyncio.sleep(60)
        await asyncio.sleep(60)

    task = asyncio.create_task(loses_one_cancel())
    await asyncio.sleep(0)
    await asyncio.wait_for(_stop_all([task]), 10)
    assert task.cancelled()
