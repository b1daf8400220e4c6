"""The gateway's event-loop lag: the pure stall arithmetic, the monitor on a real loop, and a connect
that times out while the loop itself is blocked, which is retried but never ejects the replica,
while one that times out on a running loop still counts."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import httpx
import pytest
from corral_gateway.app import create_app
from corral_gateway.fleet import Fleet
from corral_gateway.loop_lag import LoopLag, is_loop_stall, stalled_within
from corral_gateway.metrics import EVENT_LOOP_LAG_SECONDS, GatewayMetrics
from corral_gateway.settings import GatewaySettings
from corral_gateway.upstream import ConnectTimedOut, Fetched, Upstream
from prometheus_client import CollectorRegistry, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.gateway.conftest import FakeEngine, serve
from tests.gateway.test_gateway_proxy import eventually, replicas
from tests.gateway.test_gateway_retry import COMPLETION

CONNECT_TIMEOUT_S = 0.15
STALL_S = 0.4  # longer than the connect timeout: connects in flight then time out


def test_stalled_within_counts_the_overlap_of_each_late_wake_and_a_wake_still_due() -> None:
    # Wakes at 10.0 (0.5 s late: covers 9.5-10.0) and 10.3 (0.1 s late: 10.2-10.3).
    samples = [(10.0, 0.5), (10.3, 0.1)]
    assert stalled_within(samples, 9.0, 11.0, None) == pytest.approx(0.6)
    assert stalled_within(samples, 9.8, 11.0, None) == pytest.approx(0.3)  # 9.8-10.0 and 10.2-10.3
    assert stalled_within(samples, 10.25, 10.28, None) == pytest.approx(0.03)
    assert stalled_within(samples, 10.5, 11.0, None) == 0.0
    # The monitor was due at 10.6 and has not woken by 11.0: the loop is stalled right now.
    assert stalled_within(samples, 10.5, 11.0, 10.6) == pytest.approx(0.4)
    assert stalled_within([], 10.8, 11.0, 10.6) == pytest.approx(0.2)  # only the span asked about
    assert stalled_within([], 10.0, 11.0, 11.5) == 0.0  # due later: asleep, not late


def test_a_connect_timeout_is_the_loops_when_it_stalled_for_half_the_timeout_or_more() -> None:
    assert is_loop_stall(2.5, 5.0) and is_loop_stall(4.9, 5.0) and is_loop_stall(1.4, 2.0)
    assert not is_loop_stall(2.4, 5.0) and not is_loop_stall(0.0, 5.0) and not is_loop_stall(0.9, 2.0)


async def test_the_monitor_measures_a_blocked_loop_while_blocked_and_after() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("lag_seconds", "", buckets=(0.01, 0.25, 1), registry=registry)
    lag = LoopLag(histogram, horizon_s=10.0, tick_s=0.01)
    monitor = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # blocks the loop, as a burst's parsing and connects did
        # Asked before the monitor could run: the wake still due is the stall under way.
        assert lag.stalled_s(0.2) == pytest.approx(0.2, abs=0.02) and lag.is_stalled(0.2)
        await asyncio.sleep(0.05)
        assert lag.stalled_s(5.0) >= 0.25  # now from the late wake the monitor recorded
    finally:
        monitor.cancel()
    count = registry.get_sample_value("lag_seconds_count") or 0.0
    assert count - (registry.get_sample_value("lag_seconds_bucket", {"le": "0.25"}) or 0.0) >= 1.0


def test_the_loop_lag_histogram_is_exported() -> None:
    assert f"{EVENT_LOOP_LAG_SECONDS}_count 0.0" in GatewayMetrics().render().decode()


@dataclass
class Stall:
    """Connects to `port` block the thread that makes them for `stall_s` while `is_on`."""

    port: int
    stall_s: float
    is_on: bool = False
    num_stalled: int = 0


@contextmanager
def stalling_connects(stall: Stall) -> Iterator[Stall]:
    """Every TCP connect to the stall's port made in this process blocks its thread (the event loop)
    right after the kernel took it: the connect is complete, its timer runs out meanwhile."""
    connect = socket.socket.connect

    def stalled(self: socket.socket, address: Any) -> None:
        try:
            connect(self, address)
        finally:
            if stall.is_on and isinstance(address, tuple) and address[1] == stall.port:
                stall.num_stalled += 1
                time.sleep(stall.stall_s)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", stalled)
        yield stall


def closing_posts(app: ASGIApp) -> ASGIApp:
    """`app`, asking to close the connection after each POST's answer: every request to it connects
    anew (its load polls' kept-alive connection stays)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        is_post = scope["type"] == "http" and scope["method"] == "POST"
        await app(scope, receive, closing if is_post else send)

    return wrapped


@asynccontextmanager
async def gateway(
    urls: list[str], connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway in front of `urls` (model `m`, round-robin, a short connect timeout)."""
    settings = GatewaySettings(
        backends={"m": urls}, poll_interval_s=0.02, connect_timeout_s=connect_timeout_s, policy="round-robin"
    )
    async with (
        serve(create_app(settings)) as (gw_url, _),
        httpx.AsyncClient(base_url=gw_url, timeout=30) as client,
    ):
        yield client


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_connects_timed_out_by_a_blocked_loop_are_retried_but_never_eject_the_replica() -> None:
    """Two replicas; each request's connect to the first blocks the gateway's loop past the connect
    timeout. Those timeouts used to count as the replica's failures, three of which ejected a
    healthy replica; now they are the loop's: retried elsewhere, labelled apart, not counted."""
    stalled_engine = FakeEngine(name="stalled", health_has_load=True)  # polls keep one connection
    other = FakeEngine(name="other", health_has_load=True)
    async with (
        serve(closing_posts(stalled_engine.app())) as (url, _),
        serve(other.app()) as (other_url, _),
        gateway([url, other_url]) as client,
    ):

        async def is_known() -> bool:
            return all(r["serves_model"] for r in (await replicas(client)).values())

        await eventually(is_known)
        with stalling_connects(Stall(_port(url), STALL_S, is_on=True)) as stall:
            for _ in range(12):
                response = await client.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 200
                if stall.num_stalled >= 3:  # a healthy replica used to be ejected by three
                    break
            stall.is_on = False
        assert stall.num_stalled >= 3
        metrics = (await client.get("/metrics")).text
        assert f'corral_gateway_ejections_total{{replica="{url}"}} 0.0' in metrics
        state = (await replicas(client))[url]
        assert not state["ejected"] and state["num_consecutive_failures"] == 0
        assert 'corral_gateway_retries_total{model="m",reason="connect_timeout"} 0.0' in metrics
        assert (
            _sample(metrics, 'corral_gateway_retries_total{model="m",reason="connect_timeout_loop_stall"}')
            >= 1
        )
        late = _sample(metrics, f"{EVENT_LOOP_LAG_SECONDS}_count") - _sample(
            metrics, f'{EVENT_LOOP_LAG_SECONDS}_bucket{{le="0.25"}}'
        )
        assert late >= 1  # the stalls, each longer than 0.25 s
        # The stalls over, the replica takes its share again.
        served = set()
        for _ in range(4):
            served.add((await client.post("/v1/completions", json=COMPLETION)).json()["served_by"])
        assert served == {"stalled", "other"}


def _sample(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


@contextmanager
def unanswered_listener() -> Iterator[str]:
    """A loopback port whose accept queue is full (one connection held, never accepted): the kernel
    drops every further SYN, so a connect there times out with nothing stalled."""
    with socket.socket() as listener, socket.socket() as held:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        held.connect(listener.getsockname())
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def test_connects_timed_out_on_a_running_loop_still_eject_the_replica() -> None:
    # A timeout long enough that a loaded test machine's scheduling does not read as a stall.
    with unanswered_listener() as silent_url:
        async with (
            serve(FakeEngine(name="other").app()) as (other_url, _),
            gateway([silent_url, other_url], connect_timeout_s=0.5) as client,
        ):
            for _ in range(2):
                response = await client.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 200 and response.json()["served_by"] == "other"

            async def is_ejected() -> bool:
                return bool((await replicas(client))[silent_url]["ejected"])

            await eventually(is_ejected, timeout_s=15.0)
            metrics = (await client.get("/metrics")).text
            assert _sample(metrics, f'corral_gateway_ejections_total{{replica="{silent_url}"}}') >= 1


class _StalledConnects:
    """An upstream whose every GET's connect times out; with `stall_s`, after blocking the loop
    that long first (the connect timed out because the loop stalled)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    async def get(self, url: str, timeout_s: float, headers: object = None) -> Fetched:
        time.sleep(self.stall_s)
        raise ConnectTimedOut("ConnectionTimeoutError")


@asynccontextmanager
async def monitored_fleet() -> AsyncIterator[tuple[Fleet, list[float]]]:
    """A fleet of two replicas (a, b) on a fake clock, its loop-lag monitor running."""
    now = [100.0]
    # 0.5 s: a stall of STALL_S is most of it, a loaded test machine's scheduling is not.
    settings = GatewaySettings(backends={"m": ["http://a", "http://b"]}, connect_timeout_s=0.5)
    fleet = Fleet(settings, GatewayMetrics(), clock=lambda: now[0])
    monitor = asyncio.create_task(fleet.loop_lag.run())
    await asyncio.sleep(0.1)
    try:
        yield fleet, now
    finally:
        monitor.cancel()


def _state(fleet: Fleet, url: str) -> dict[str, object]:
    return next(r for r in fleet.snapshot()["m"] if r["url"] == url)


@pytest.mark.parametrize("is_stalled", [True, False])
async def test_load_polls_whose_connects_time_out_in_a_stall_do_not_count(is_stalled: bool) -> None:
    async with monitored_fleet() as (fleet, _):
        upstream = cast(Upstream, _StalledConnects(STALL_S if is_stalled else 0.0))
        for _ in range(3):
            assert await fleet.pollers._poll_get(upstream, "http://a", "/health") is None
            await asyncio.sleep(0.1)  # the loop runs again between polls
        # A timeout on a running loop is the replica's: three eject it, as a refused connect does.
        assert _state(fleet, "http://a")["ejected"] is not is_stalled
        assert _state(fleet, "http://a")["num_consecutive_failures"] == (0 if is_stalled else 3)


async def test_a_probe_whose_connect_times_out_in_a_stall_does_not_prolong_the_ejection() -> None:
    async with monitored_fleet() as (fleet, now):
        for _ in range(3):
            fleet.record_failure("http://a", "connect refused")  # ejected for 2 s
        now[0] += 2.0  # due for its probe
        upstream = cast(Upstream, _StalledConnects(STALL_S))
        assert not await fleet.pollers._probe(upstream, "http://a")
        assert fleet._registry.is_due_for_probe("http://a", now[0])  # no verdict: probed again at once
        assert fleet._registry.by_url("http://a")[0].num_ejections == 1
