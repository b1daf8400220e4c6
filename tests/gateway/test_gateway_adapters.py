"""LoRA adapters in the gateway, without I/O: the LoRA state read from vLLM's metric, which pool an
adapter name goes to, how the gateway lists it, and the affinity order replicas are picked in."""

from __future__ import annotations

import asyncio
import logging

import pytest
from corral_engine import wire
from corral_gateway.adapters import Affinity, adapters_of, affinity
from corral_gateway.admission import Ask
from corral_gateway.errors import AmbiguousAdapter
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import Discovery
from corral_gateway.k8s_names import Route, Served, naming
from corral_gateway.load import LoadSample, LoraState, parse_lora_info
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.peek import RequestInfo, block_hash_chain, for_adapter
from corral_gateway.policies import Candidate, PrefixAffinity, make_policy
from corral_gateway.registry import Registry, Replica, Saturation
from corral_gateway.router import NoReplica, Router
from corral_gateway.settings import GatewaySettings

SAT = Saturation(max_waiting=5, max_kv_usage_ratio=0.8)
CARD = {"created": 5, "owned_by": "vllm", "max_model_len": 4096}  # what a listing passes on

# vLLM v1's exposition: labels in its declared order (max_lora, waiting, running), one series per
# state it has been in, each valued the Unix time it was last set.
VLLM_V1 = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",running_lora_adapters=""} 1.6999990e+09
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="chat",running_lora_adapters="sql,chat"} 1.7e+09
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",running_lora_adapters="sql"} 1.6999995e+09
vllm:num_requests_running{model_name="m"} 3.0
"""


@pytest.mark.parametrize(
    ("text", "state"),
    [
        (VLLM_V1, LoraState(frozenset({"sql", "chat"}), frozenset({"chat"}), 2)),
        # vLLM v0's label order; nothing running or waiting: empty labels, no names.
        (
            '# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{running_lora_adapters="",'
            'max_lora="4",waiting_lora_adapters=""} 1.7e+09\n',
            LoraState(frozenset(), frozenset(), 4),
        ),
        (
            'vllm:lora_requests_info{running_lora_adapters="a, b"} 1\n',
            LoraState(frozenset("ab"), frozenset(), None),
        ),
        ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 1\n', None),
        ("vllm:lora_requests_info{max_lora=4} 1\n", None),  # not the exposition format
    ],
)
def test_the_latest_lora_state_is_read_from_vllms_metric(text: str, state: LoraState | None) -> None:
    assert parse_lora_info(text) == state


def test_the_metrics_label_names_are_vllms() -> None:
    assert (wire.LORA_MAX_LABEL, wire.LORA_RUNNING_LABEL, wire.LORA_WAITING_LABEL) == (
        "max_lora",
        "running_lora_adapters",
        "waiting_lora_adapters",
    )


def listing(base: str, **adapters: str) -> dict[str, dict[str, object]]:
    """A replica's /v1/models as `parse_model_list` reads it: the base model and its adapters."""
    card = {"object": "model", **CARD}
    listed: dict[str, dict[str, object]] = {base: {**card, "root": f"/models/{base}", "parent": None}}
    listed |= {name: {**card, "root": root, "parent": base} for name, root in adapters.items()}
    return listed


def test_a_replicas_adapters_are_the_entries_whose_parent_is_its_model() -> None:
    listed = listing("llama", sql="/adapters/sql") | {
        "other": {"parent": "qwen"},
        "bare": {"parent": "llama"},
    }
    assert adapters_of(listed, "llama") == {"sql": {**CARD, "root": "/adapters/sql"}, "bare": {}}
    assert adapters_of(listed, "qwen") == {"other": {}}


def static_fleet(backends: dict[str, list[str]]) -> Fleet:
    return Fleet(GatewaySettings(backends=backends), GatewayMetrics())


def test_an_adapter_routes_to_its_base_pool_and_is_listed_once() -> None:
    fleet = static_fleet({"llama": ["http://a", "http://b"], "qwen": ["http://c"]})
    fleet.observe_served_names("http://a", listing("llama", sql="/adapters/sql"))
    fleet.observe_served_names("http://b", listing("llama", sql="/adapters/sql", chat="/adapters/chat"))
    fleet.observe_served_names("http://c", listing("qwen"))
    assert fleet.resolve("sql") == Route("llama", "sql", adapter="sql")
    assert fleet.resolve("llama") == Route("llama", "llama")
    assert fleet.listed_models() == ["chat", "llama", "qwen", "sql"]
    sql = {"id": "sql", "object": "model", **CARD, "root": "/adapters/sql", "parent": "llama"}
    assert fleet.model_entry("sql") == sql
    # The base model's entry passes on its card, not the replica's own path.
    assert fleet.model_entry("llama") == {"id": "llama", "object": "model", **CARD}
    # Unloaded at runtime: gone from the list and from routing.
    fleet.observe_served_names("http://a", listing("llama"))
    fleet.observe_served_names("http://b", listing("llama", sql="/adapters/sql"))
    assert fleet.listed_models() == ["llama", "qwen", "sql"]
    assert fleet.resolve("chat") == Route("chat", "chat") and not fleet.has_model("chat")


def test_an_adapter_leaves_with_its_last_replica() -> None:
    fleet = static_fleet({"llama": ["http://a"]})
    fleet.apply_discovery(Discovery({"llama": ["http://b"]}, {}, naming([])))
    fleet.observe_served_names("http://b", listing("llama", sql="/adapters/sql"))
    assert fleet.resolve("sql").adapter == "sql"
    fleet.apply_discovery(Discovery({"llama": []}, {}, naming([])))
    assert fleet.resolve("sql").adapter is None and "sql" not in fleet.listed_models()


def test_an_adapter_of_a_pool_qualified_by_namespace_names_that_pool_as_parent() -> None:
    fleet = Fleet(GatewaySettings(kubernetes={"enabled": True}), GatewayMetrics())
    names = naming([Served("team-a", "x", "llama"), Served("team-b", "y", "llama")])
    fleet.apply_discovery(Discovery({"team-a/llama": ["http://a"], "team-b/llama": ["http://b"]}, {}, names))
    fleet.observe_served_names("http://a", listing("llama", sql="/adapters/sql"))  # the engine's name
    assert fleet.resolve("sql") == Route("team-a/llama", "sql", adapter="sql")
    assert fleet.model_entry("sql")["parent"] == "team-a/llama"


def test_an_adapter_named_like_a_model_or_alias_is_not_taken_over(caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(GatewaySettings(kubernetes={"enabled": True}), GatewayMetrics())
    names = naming([Served("ns", "x", "llama", ("chat",)), Served("ns", "y", "qwen")])
    fleet.apply_discovery(Discovery({"llama": ["http://a"], "qwen": ["http://b"]}, {}, names))
    with caplog.at_level(logging.WARNING, logger="corral_gateway.adapters"):
        fleet.observe_served_names(
            "http://b", listing("qwen", chat="/a/chat", llama="/a/llama", sql="/a/sql")
        )
        fleet.observe_served_names("http://b", listing("qwen", chat="/a/chat", llama="/a/llama"))
        fleet.observe_served_names(
            "http://b", listing("qwen", chat="/a/chat", llama="/a/llama", sql="/a/sql")
        )
    assert fleet.resolve("chat") == Route("llama", "llama")  # the alias still
    assert fleet.resolve("llama") == Route("llama", "llama")
    assert fleet.resolve("sql").adapter == "sql"
    assert fleet.listed_models() == ["chat", "llama", "qwen", "sql"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("is not routed" in m for m in warned)  # once per name


def test_an_adapter_listed_under_two_models_is_refused() -> None:
    fleet = static_fleet({"llama": ["http://a"], "qwen": ["http://b"]})
    fleet.observe_served_names("http://a", listing("llama", sql="/a/sql"))
    fleet.observe_served_names("http://b", listing("qwen", sql="/b/sql"))
    with pytest.raises(AmbiguousAdapter) as raised:
        fleet.resolve("sql")
    assert raised.value.status_code == 400 and "`llama`, `qwen`" in raised.value.message
    assert "sql" not in fleet.listed_models()


def lora_replica(url: str, adapters: tuple[str, ...], lora: LoraState | None, waiting: float = 0) -> Replica:
    replica = Replica(model="m", url=url, adapters={a: {} for a in adapters}, lora=lora)
    replica.observe(LoadSample(1, waiting, 0.1, at_s=100.0))
    return replica


def state(running: str = "", waiting: str = "", max_lora: int | None = 2) -> LoraState:
    return LoraState(frozenset(running.split()), frozenset(waiting.split()), max_lora)


def test_affinity_tiers_follow_the_replicas_adapter_state() -> None:
    assert affinity(lora_replica("a", ("x",), state(running="x y")), "x") is Affinity.ACTIVE
    assert affinity(lora_replica("a", ("x",), state(waiting="x")), "x") is Affinity.ACTIVE
    assert affinity(lora_replica("a", ("x",), state(running="y")), "x") is Affinity.FREE_SLOT
    assert affinity(lora_replica("a", ("x",), None), "x") is Affinity.FREE_SLOT  # nothing said
    assert affinity(lora_replica("a", ("x",), state(max_lora=None)), "x") is Affinity.FREE_SLOT
    assert affinity(lora_replica("a", ("x",), state(running="y", waiting="z")), "x") is Affinity.FULL
    full = lora_replica("a", ("x",), state(running="y", waiting="z"))
    full.on_dispatch("x")  # this gateway's own request holds it there until it ends
    assert affinity(full, "x") is Affinity.ACTIVE
    full.on_done("x")
    assert affinity(full, "x") is Affinity.FULL and full.num_inflight_by_adapter == {}


def adapter_router(replicas: list[Replica], seen: list[tuple[str, Affinity]] | None = None) -> Router:
    registry = Registry()
    registry.set_replicas("m", [r.url for r in replicas])
    for replica in replicas:
        known = registry.replicas("m")[[r.url for r in registry.replicas("m")].index(replica.url)]
        known.adapters, known.lora, known.sample = replica.adapters, replica.lora, replica.sample
    on_affinity = None if seen is None else (lambda model, tier: seen.append((model, tier)))
    return Router(registry, make_policy("kv-aware", SAT), SAT, 2.0, lambda: 100.0, on_affinity)


def picked(router: Router, adapter: str | None = None) -> str:
    """The URL the router routes a request (of `adapter`) to."""
    routed = router.route("m", None, adapter=adapter)
    assert isinstance(routed, Replica)
    return routed.url


def test_an_adapter_request_goes_only_to_replicas_listing_the_adapter() -> None:
    router = adapter_router([lora_replica("http://a", (), None), lora_replica("http://b", ("x",), None)])
    assert {picked(router, "x") for _ in range(4)} == {"http://b"}
    assert {picked(router) for _ in range(4)} == {"http://a", "http://b"}
    assert router.route("m", None, adapter="y") == NoReplica(is_saturated=False)
    assert router.route("m", None, exclude=["http://b"], adapter="x") == NoReplica(is_saturated=False)


def test_affinity_prefers_active_then_a_free_slot_then_the_rest_among_unsaturated() -> None:
    seen: list[tuple[str, Affinity]] = []
    replicas = [
        lora_replica("http://full", ("x",), state(running="y z")),
        lora_replica("http://free", ("x",), state(running="y")),
        lora_replica("http://active", ("x",), state(running="y", waiting="x"), waiting=3),  # busier
    ]
    router = adapter_router(replicas, seen)
    assert picked(router, adapter="x") == "http://active"
    # Saturated where it is active: to a free slot, not into its queue.
    router.registry.observe("http://active", LoadSample(1, 9, 0.1, at_s=100.0))
    assert picked(router, adapter="x") == "http://free"
    router.registry.observe("http://free", LoadSample(1, 9, 0.1, at_s=100.0))
    assert picked(router, adapter="x") == "http://full"
    # Every one saturated: the saturation check still queues the request.
    router.registry.observe("http://full", LoadSample(1, 9, 0.1, at_s=100.0))
    assert router.route("m", None, adapter="x") == NoReplica(is_saturated=True)
    assert seen == [("m", Affinity.ACTIVE), ("m", Affinity.FREE_SLOT), ("m", Affinity.FULL)]


def test_affinity_leaves_the_load_policy_to_choose_within_a_tier() -> None:
    replicas = [
        lora_replica("http://busy", ("x",), state(running="x"), waiting=4),
        lora_replica("http://idle", ("x",), state(running="x")),
        lora_replica("http://other", ("x",), state()),
    ]
    router = adapter_router(replicas)
    assert picked(router, adapter="x") == "http://idle"
    # A base-model request is not drawn by adapters: the least-loaded of all.
    assert picked(router) in {"http://idle", "http://other"}


def test_an_adapters_prefix_hashes_are_its_own() -> None:
    prompt = "the same long system prompt, block after block, " * 8
    chain = block_hash_chain(prompt, 64, 4)
    base = RequestInfo("m", False, 7, 10, chain)
    sql, sql_again, chat = for_adapter(base, "sql"), for_adapter(base, "sql"), for_adapter(base, "chat")
    assert sql == sql_again and sql.prefix_hash != base.prefix_hash != chat.prefix_hash
    assert not set(sql.block_hashes) & (set(chain) | set(chat.block_hashes))
    # Still a chain: a longer prompt of the adapter shares the shorter one's hashes.
    longer = for_adapter(RequestInfo("m", False, 7, 10, block_hash_chain(prompt + "more" * 40, 64, 6)), "sql")
    assert longer.block_hashes[:4] == sql.block_hashes
    # Where the base model's prompt went, the adapter's same prompt finds nothing cached.
    policy = PrefixAffinity(SAT)
    replicas = [lora_replica("http://a", ("sql",), None), lora_replica("http://b", ("sql",), None)]
    warm = policy.pick([Candidate(r, r.load(100.0, 2.0)) for r in replicas], None, chain).replica.url
    assert policy.index.matched_blocks([warm], sql.block_hashes) == {warm: 0}


async def test_a_lease_holds_its_adapter_on_the_replica_until_it_ends() -> None:
    fleet = Fleet(GatewaySettings(backends={"m": ["http://a"]}, saturation_max_waiting=5), GatewayMetrics())
    fleet.observe_served_names("http://a", listing("m", x="/adapters/x"))
    async with fleet.lease(Ask("m", adapter="x")) as replica:
        assert replica.num_inflight_by_adapter == {"x": 1}
    assert replica.num_inflight_by_adapter == {}
    # From the queue too: saturated, then room as a base request ends.
    async with fleet.lease(Ask("m")):
        fleet.observe_headers("http://a", load_headers(num_waiting=9))
        queued = asyncio.create_task(_hold(fleet, Ask("m", adapter="x")))
        await asyncio.sleep(0.01)
        assert not queued.done() and replica.num_inflight_by_adapter == {}
        fleet.observe_headers("http://a", load_headers(num_waiting=0))
    assert await queued == {"x": 1} and replica.num_inflight_by_adapter == {}


async def _hold(fleet: Fleet, ask: Ask) -> dict[str, int]:
    async with fleet.lease(ask) as replica:
        return dict(replica.num_inflight_by_adapter)


def load_headers(num_waiting: int) -> dict[str, str]:
    return {
        wire.HEADER_NUM_RUNNING: "1",
        wire.HEADER_NUM_WAITING: str(num_waiting),
        wire.HEADER_KV_USAGE: "0",
    }
