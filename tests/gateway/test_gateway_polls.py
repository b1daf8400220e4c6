"""When the gateway polls a replica for its load: only when no response brought it recently."""

from __future__ import annotations

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
