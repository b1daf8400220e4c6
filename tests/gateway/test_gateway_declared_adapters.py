"""LoRA adapters an LLMDeployment declares (`spec.adapters`), in the fleet: routed to the deployment's
pool before any replica lists them (at zero replicas, where they wake it; on replicas that have
not said what they serve), listed under it, and refused where the names rule says so."""

from __future__ import annotations

import asyncio
import logging

import pytest
from corral_gateway.admission import Ask
from corral_gateway.errors import AmbiguousAdapter, AmbiguousModel
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import Discovery, discover
from corral_gateway.k8s_names import Route, Served
from corral_gateway.k8s_wake import Waker
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.registry import Replica
from corral_gateway.settings import GatewaySettings

from tests.gateway.test_gateway_adapters import listing

SQL = Route("llama", "sql", adapter="sql")


def k8s_fleet(*served: Served, queue_timeout_s: float = 30.0) -> tuple[Fleet, list[str]]:
    """A fleet that discovered `served` at zero replicas, and the deployments it woke."""
    settings = GatewaySettings(
        kubernetes={"enabled": True, "wake_timeout_s": 5.0}, queue_timeout_s=queue_timeout_s
    )
    fleet = Fleet(settings, GatewayMetrics())
    woken: list[str] = []
    fleet.waker = Waker(None, patch=lambda ns, name, body: woken.append(f"{ns}/{name}"))
    set_replicas(fleet, served, [])
    return fleet, woken


def set_replicas(fleet: Fleet, served: tuple[Served, ...], urls: list[str]) -> None:
    """Discovery of `served` (k8s_discovery.discover), with `urls` the replicas of the first one."""
    found = discover([], is_pods=True, model_label="corral.dev/model", port_name="http", served=served)
    pool = found.names.keys[(served[0].namespace, served[0].deployment)]
    fleet.apply_discovery(Discovery(found.pools | {pool: urls}, found.owners, found.names))


LLAMA = Served("ml", "llama", "llama", ("chat-model",), adapters=("sql",))


async def test_a_declared_adapter_at_zero_replicas_is_listed_and_its_request_wakes_the_pool() -> None:
    fleet, woken = k8s_fleet(LLAMA, queue_timeout_s=0.05)
    assert fleet.resolve("sql") == fleet.resolve("ml/sql") == SQL
    assert fleet.listed_models() == ["chat-model", "llama", "sql"]
    entry = {"id": "sql", "object": "model", "created": 0, "owned_by": "corral", "parent": "llama"}
    assert fleet.model_entry("sql") == entry
    assert fleet.model_entry("ml/sql") == entry | {"id": "ml/sql"}
    assert not fleet.is_unserved(SQL)
    timeout_s = fleet.wake_timeout_s("llama")
    assert timeout_s == 5.0
    async with asyncio.timeout(60):  # a guard: the patch's thread imports the kubernetes client
        while not woken:
            await asyncio.sleep(0.01)
    assert woken == ["ml/llama"]
    waiter = asyncio.create_task(_lease(fleet, Ask("llama", timeout_s=timeout_s, adapter="sql")))
    await asyncio.sleep(0.2)  # longer than the normal queue deadline
    assert not waiter.done()
    # The first replica has not said what it serves yet: it counts as serving the declared adapter.
    set_replicas(fleet, (LLAMA,), ["http://127.0.0.1:9"])
    replica = await asyncio.wait_for(waiter, 2)
    assert replica.url == "http://127.0.0.1:9" and replica.served_names is None


async def _lease(fleet: Fleet, ask: Ask) -> Replica:
    async with fleet.lease(ask) as replica:
        return replica


def test_once_replicas_say_what_they_serve_only_those_listing_the_adapter_take_it() -> None:
    fleet, _ = k8s_fleet(LLAMA)
    set_replicas(fleet, (LLAMA,), ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert fleet.has_candidates("llama", adapter="sql")  # neither has said
    fleet.observe_served_names("http://127.0.0.1:1", listing("llama"))  # an old replica, without it
    assert not fleet.has_candidates("llama", exclude=["http://127.0.0.1:2"], adapter="sql")
    assert fleet.has_candidates("llama", exclude=["http://127.0.0.1:1"], adapter="sql")  # not said yet
    fleet.observe_served_names("http://127.0.0.1:2", listing("llama"))
    # Every replica said, none lists it: 404 at once, not a wait in the base model's queue.
    assert not fleet.has_candidates("llama", adapter="sql") and fleet.is_unserved(SQL)
    fleet.observe_served_names("http://127.0.0.1:2", listing("llama", sql="/models-cache/sql"))
    assert not fleet.is_unserved(SQL)
    assert fleet.model_entry("sql")["root"] == "/models-cache/sql"
    assert fleet.listed_models() == ["chat-model", "llama", "sql"]  # once


def test_a_declared_adapter_in_two_namespaces_is_asked_for_as_namespace_slash_name() -> None:
    team_a = Served("team-a", "llama", "llama", adapters=("sql",))
    team_b = Served("team-b", "qwen", "qwen", adapters=("sql",))
    fleet, _ = k8s_fleet(team_a, team_b)
    assert fleet.resolve("team-a/sql") == SQL
    assert fleet.resolve("team-b/sql") == Route("qwen", "sql", adapter="sql")
    with pytest.raises(AmbiguousModel, match="ask for one of `team-a/sql`, `team-b/sql`"):
        fleet.resolve("sql")
    assert fleet.listed_models() == ["llama", "qwen", "team-a/sql", "team-b/sql"]
    assert fleet.model_entry("team-b/sql")["parent"] == "qwen"
    # A pool of that name (a hand-made Service's model label) is what a client means by it.
    found = discover(
        [], is_pods=True, model_label="corral.dev/model", port_name="http", served=(team_a, team_b)
    )
    fleet.apply_discovery(Discovery(found.pools | {"sql": []}, found.owners, found.names))
    assert fleet.resolve("sql") == Route("sql", "sql")


def test_declared_adapters_keep_the_collision_rules(caplog: pytest.LogCaptureFixture) -> None:
    # qwen's adapters: one named like llama's alias, one like llama itself, one like qwen's own
    # adapter in another pool of the namespace.
    qwen = Served("ml", "qwen", "qwen", adapters=("chat-model", "llama", "sql"))
    with caplog.at_level(logging.WARNING, logger="corral_gateway.adapters"):
        fleet, _ = k8s_fleet(LLAMA, qwen)
        set_replicas(fleet, (LLAMA, qwen), ["http://127.0.0.1:1"])  # rebuilt: no second warning
    assert fleet.resolve("chat-model") == Route("llama", "llama")  # the alias still
    assert fleet.resolve("llama") == Route("llama", "llama")
    with pytest.raises(AmbiguousAdapter):
        fleet.resolve("sql")
    assert fleet.resolve("ml/llama") == Route("llama", "llama")  # the model's own qualified name
    assert fleet.listed_models() == ["chat-model", "llama", "qwen"]
    warned = sorted(r.getMessage().split(" ")[1] for r in caplog.records)
    assert warned == ["'chat-model'", "'llama'", "'sql'"]  # once each (not again as ml/NAME)
