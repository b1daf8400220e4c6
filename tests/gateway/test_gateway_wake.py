"""Scale from zero: the owner lookup, the rate-limited wake patch, and requests waiting for a replica."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from corral_engine import wire
from corral_gateway.admission import Ask
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import Discovery, discover
from corral_gateway.k8s_names import Served
from corral_gateway.k8s_wake import Waker, wake_patch
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.registry import Replica
from corral_gateway.settings import GatewaySettings


def test_owners_from_operator_labels() -> None:
    objs = [
        {
            "metadata": {
                "namespace": "ns",
                "labels": {"corral.dev/model": "m", "app.kubernetes.io/instance": "llmd"},
            }
        },
        {"metadata": {"namespace": "ns", "labels": {"corral.dev/model": "x"}}},  # no owner label
    ]
    found = discover(objs, is_pods=True, model_label="corral.dev/model", port_name="http")
    assert found.owners == {"m": ("ns", "llmd")}


def test_wake_patch_is_an_rfc3339_annotation() -> None:
    assert wake_patch(0.0) == {"metadata": {"annotations": {wire.WAKE_ANNOTATION: "1970-01-01T00:00:00Z"}}}


def test_waker_patches_at_most_once_per_interval() -> None:
    calls: list[tuple[str, str, dict[str, Any]]] = []
    done = threading.Event()

    def patch(namespace: str, name: str, body: dict[str, Any]) -> None:
        calls.append((namespace, name, body))
        done.set()

    now = [100.0]
    waker = Waker(None, min_interval_s=10.0, clock=lambda: now[0], patch=patch)
    assert not waker.wake("m")  # owner unknown
    waker.set_owners({"m": ("ns", "llmd")})
    assert waker.wake("m") and done.wait(5)
    assert waker.wake("m")  # still waking, but no second patch yet
    now[0] = 111.0
    done.clear()
    assert waker.wake("m") and done.wait(5)
    assert [(c[0], c[1]) for c in calls] == [("ns", "llmd"), ("ns", "llmd")]


def test_a_model_nothing_wakes_gets_the_normal_queue_deadline() -> None:
    settings = GatewaySettings(kubernetes={"enabled": True, "wake_timeout_s": 300.0}, queue_timeout_s=30)
    fleet = Fleet(settings, GatewayMetrics())
    woken: list[str] = []
    fleet.waker = Waker(None, patch=lambda ns, name, body: woken.append(name))
    off = Served("ml", "off", "m", can_wake=False)
    fleet.apply_discovery(
        discover([], is_pods=True, model_label="corral.dev/model", port_name="http", served=[off])
    )
    assert fleet.wake_timeout_s("m") is None  # the 30 s queue deadline, not 300 s for a wake-up
    assert woken == []


async def test_request_for_a_model_at_zero_waits_for_a_replica() -> None:
    settings = GatewaySettings(kubernetes={"enabled": True, "wake_timeout_s": 5.0}, queue_timeout_s=0.05)
    fleet = Fleet(settings, GatewayMetrics())
    woken: list[str] = []
    fleet.waker = Waker(None, patch=lambda ns, name, body: woken.append(name))
    owners = {"m": ("ns", "llmd")}
    fleet.apply_discovery(Discovery({"m": []}, owners))
    assert fleet.waker.owners == owners
    timeout_s = fleet.wake_timeout_s("m")
    assert timeout_s == 5.0

    async def lease() -> Replica:
        async with fleet.lease(Ask("m", timeout_s=timeout_s)) as replica:
            return replica

    waiter = asyncio.create_task(lease())
    await asyncio.sleep(0.2)  # longer than the normal queue deadline
    assert not waiter.done()
    fleet.apply_discovery(Discovery({"m": ["http://127.0.0.1:9"]}, owners))
    replica = await asyncio.wait_for(waiter, 2)
    assert isinstance(replica, Replica) and replica.url == "http://127.0.0.1:9"
    assert fleet.wake_timeout_s("m") is None  # a replica is in rotation now
