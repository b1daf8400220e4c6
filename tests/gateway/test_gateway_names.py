"""Served names, aliases and namespaces -> what a client may ask for (k8s_names.naming), and the
proxy's side: an alias is routed to its pool and sent upstream under the served name."""

from __future__ import annotations

import json

import pytest
from corral_gateway.errors import AmbiguousModel
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import Discovery, discover
from corral_gateway.k8s_names import Route, Served, naming, served_from_deployments
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.peek import with_model
from corral_gateway.settings import GatewaySettings


def test_names_and_aliases_in_one_namespace_route_to_the_deployments_pool() -> None:
    names = naming([Served("ml", "llama", "meta-llama/Llama-3.1-8B", ("llama", "default"))])
    pool = Route("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B")
    assert names.routes["meta-llama/Llama-3.1-8B"] == pool
    assert names.routes["llama"] == names.routes["default"] == pool
    assert names.routes["ml/meta-llama/Llama-3.1-8B"] == names.routes["ml/llama"] == pool
    assert names.aliases == {"llama": pool.key, "default": pool.key}
    assert names.ambiguous == {}


def test_deployments_of_one_name_in_one_namespace_pool_together() -> None:
    names = naming([Served("ml", "blue", "m"), Served("ml", "green", "m")])
    assert names.keys == {("ml", "blue"): "m", ("ml", "green"): "m"}


def test_a_name_in_two_namespaces_must_be_qualified() -> None:
    names = naming(
        [Served("team-a", "x", "llama"), Served("team-b", "y", "llama"), Served("team-b", "z", "qwen")]
    )
    assert "llama" not in names.routes
    assert names.ambiguous == {"llama": ["team-a/llama", "team-b/llama"]}
    assert names.routes["team-a/llama"] == Route("team-a/llama", "llama")
    assert names.keys[("team-b", "y")] == "team-b/llama"
    assert names.routes["qwen"] == Route("qwen", "qwen")  # unique names stay bare


def test_a_served_name_beats_another_deployments_alias() -> None:
    names = naming([Served("ml", "a", "big", ("small",)), Served("ml", "b", "small")])
    assert names.routes["small"] == Route("small", "small")
    assert "small" not in names.aliases


def test_deployments_json_to_served() -> None:
    items = [
        {
            "metadata": {"namespace": "ml", "name": "a"},
            "spec": {"model": {"name": "m", "aliases": ["x", "m"]}},
        },
        {"metadata": {"namespace": "ml", "name": "broken"}, "spec": {"model": {}}},
    ]
    assert served_from_deployments(items) == [Served("ml", "a", "m", ("x",), can_wake=False)]


def test_only_deployments_that_scale_from_zero_are_woken() -> None:
    def llmd(name: str, **spec: object) -> dict[str, object]:
        return {"metadata": {"namespace": "ml", "name": name}, "spec": {"model": {"name": "m"}, **spec}}

    items = [
        llmd("fixed", replicas=0),
        llmd("hpa", autoscaling={"mode": "hpa", "minReplicas": 1}),
        llmd("keda", autoscaling={"mode": "keda", "minReplicas": 0}),
        llmd("builtin", autoscaling={"minReplicas": 0}),
    ]
    assert [s.can_wake for s in served_from_deployments(items)] == [False, False, True, True]
    # one pool "m": a fixed deployment at `replicas: 0` is off, and its requests must not wait for a
    # wake-up that never comes; the pool's owner is one an autoscaler brings back
    fixed, hpa, keda, _ = served_from_deployments(items)
    pod = {"metadata": {"namespace": "ml", "labels": {"app.kubernetes.io/instance": "fixed"}}}
    found = discover(
        [pod], is_pods=True, model_label="corral.dev/model", port_name="http", served=[fixed, hpa]
    )
    assert (found.pools, found.owners) == ({"m": []}, {})
    found = discover(
        [pod], is_pods=True, model_label="corral.dev/model", port_name="http", served=[fixed, keda]
    )
    assert found.owners == {"m": ("ml", "keda")}


def test_with_model_rewrites_only_the_model() -> None:
    raw = json.dumps({"model": "alias", "messages": [{"role": "user", "content": "héllo"}], "n": 2}).encode()
    out = json.loads(with_model(raw, "org/served"))
    assert out == {"model": "org/served", "messages": [{"role": "user", "content": "héllo"}], "n": 2}


def test_fleet_resolves_aliases_lists_them_and_refuses_ambiguous_names() -> None:
    fleet = Fleet(GatewaySettings(kubernetes={"enabled": True}), GatewayMetrics())
    served = [Served("ml", "a", "org/m", ("m",)), Served("a", "x", "dup"), Served("b", "y", "dup")]
    names = naming(served)
    pools = {"org/m": ["http://127.0.0.1:1"], "a/dup": [], "b/dup": []}
    fleet.apply_discovery(Discovery(pools, {}, names))
    assert fleet.resolve("m") == Route("org/m", "org/m")
    assert fleet.resolve("unknown") == Route("unknown", "unknown")
    assert fleet.listed_models() == ["a/dup", "b/dup", "m", "org/m"]
    with pytest.raises(AmbiguousModel, match="ask for one of `a/dup`, `b/dup`"):
        fleet.resolve("dup")


def test_a_deployment_with_no_objects_is_a_known_empty_pool_with_its_owner() -> None:
    found = discover(
        [],
        is_pods=True,
        model_label="corral.dev/model",
        port_name="http",
        served=[Served("ml", "z", "org/m")],
    )
    assert found.pools == {"org/m": []}
    assert found.owners == {"org/m": ("ml", "z")}


def test_deployments_declared_adapters_are_read_beside_the_model_name() -> None:
    spec = {
        "model": {"name": "m", "aliases": ["chat"]},
        # A duplicate, a name the model has (both refused by the API server), no name, not a string.
        "adapters": [{"name": "sql"}, {"name": "sql"}, {"name": "chat"}, {"uri": "hf://x"}, {"name": 3}, "x"],
    }
    items = [{"metadata": {"namespace": "ml", "name": "a"}, "spec": spec}]
    assert served_from_deployments(items)[0].adapters == ("sql",)
    broken = [
        {"metadata": {"namespace": "ml", "name": "b"}, "spec": {"model": {"name": "m"}, "adapters": {}}}
    ]
    assert served_from_deployments(broken)[0].adapters == ()


def test_declared_adapters_route_to_their_deployments_pool_by_the_names_rule() -> None:
    served = [
        Served("team-a", "x", "llama", adapters=("sql", "chat")),
        Served("team-b", "y", "llama", adapters=("sql",)),
        Served("team-b", "z", "qwen", adapters=("summary",)),
    ]
    names = naming(served)
    sql_a, sql_b = Route("team-a/llama", "sql", adapter="sql"), Route("team-b/llama", "sql", adapter="sql")
    assert names.adapters == {
        "team-a/sql": (sql_a,),
        "team-b/sql": (sql_b,),
        "team-a/chat": (Route("team-a/llama", "chat", adapter="chat"),),
        "chat": (Route("team-a/llama", "chat", adapter="chat"),),
        "team-b/summary": (Route("qwen", "summary", adapter="summary"),),
        "summary": (Route("qwen", "summary", adapter="summary"),),
    }
    # Declared in two namespaces: NAMESPACE/NAME only, as for a model's name.
    assert names.ambiguous_adapters == {"sql": ["team-a/sql", "team-b/sql"]}
    assert "sql" not in names.routes and "sql" not in names.ambiguous  # not a model's name
    # Two pools of one namespace declaring one name: both routes, for the fleet to refuse.
    names = naming(
        [Served("ml", "a", "llama", adapters=("sql",)), Served("ml", "b", "qwen", adapters=("sql",))]
    )
    assert (
        [r.key for r in names.adapters["sql"]]
        == [r.key for r in names.adapters["ml/sql"]]
        == ["llama", "qwen"]
    )
