"""LoRA adapters loaded through the gateway, without I/O: the bodies, which pool a load goes to, what
a fan-out that failed somewhere undoes, and how remembered adapters route, wake and list in the fleet."""

from __future__ import annotations

import json

import pytest
from corral_gateway.errors import FanoutFailed, InvalidRequest, error_body
from corral_gateway.k8s_names import Route, Served
from corral_gateway.runtime_adapters import (
    Outcome,
    RuntimeAdapters,
    choose_pool,
    failure_message,
    parse_call,
    rollback_plan,
)

from tests.gateway.test_gateway_adapters import listing
from tests.gateway.test_gateway_declared_adapters import k8s_fleet, set_replicas

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


def test_a_load_body_names_the_adapter_and_its_path_and_may_name_the_base_model() -> None:
    raw = json.dumps(LOAD | {"base_model_name": "llama", "load_inplace": True}).encode()
    call = parse_call(raw, is_load=True)
    assert (call.name, call.path, call.base) == ("sql", "/adapters/sql", "llama")
    assert call.body == raw  # forwarded as sent: vLLM's other fields too
    assert parse_call(b'{"lora_name": "sql"}', is_load=False).path is None


@pytest.mark.parametrize(
    ("raw", "is_load", "param"),
    [
        (b'{"lora_name": "sql"}', True, "lora_name"),
        (b'{"lora_path": "/a"}', True, "lora_name"),
        (b"[]", False, "lora_name"),
        (b'{"lora_name": ""}', False, "lora_name"),
        (b"{not json", False, None),
        (json.dumps(LOAD | {"base_model_name": 3}).encode(), True, "base_model_name"),
    ],
)
def test_a_body_without_its_fields_is_a_400(raw: bytes, is_load: bool, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_call(raw, is_load)
    assert caught.value.status_code == 400 and caught.value.param == param


def test_without_a_base_model_the_one_lora_pool_is_chosen_or_the_choices_named() -> None:
    assert choose_pool(["llama"], "load") == "llama"
    with pytest.raises(InvalidRequest, match="No model serves LoRA adapters"):
        choose_pool([], "load")
    with pytest.raises(InvalidRequest, match=r"Several models .*`llama`, `qwen`.*base_model_name") as caught:
        choose_pool(["qwen", "llama"], "load")
    assert caught.value.code == "model_ambiguous" and caught.value.param == "base_model_name"


def test_a_failed_load_is_undone_only_where_it_loaded() -> None:
    loaded, had_it = Outcome(A, 200, is_changed=True), Outcome(B, 200)
    failed = Outcome(C, 404, error={"message": "No adapter found", "param": "lora_path"})
    assert rollback_plan([loaded, had_it]) == []  # all succeeded: nothing to undo
    assert rollback_plan([loaded, had_it, failed]) == [A]  # B had it before: it keeps it
    assert rollback_plan([failed]) == []
    message = failure_message("load", "sql", "llama", [loaded, had_it, failed], [A])
    assert message == (
        f"Could not load LoRA adapter 'sql' on 1 of 3 replicas of `llama` ({C}: HTTP 404 "
        f"(No adapter found)). It was unloaded again from {A}."
    )


def test_a_fanout_failure_answers_with_the_first_replicas_status_and_error_fields() -> None:
    error = FanoutFailed(
        "m", 404, {"message": "x", "type": "NotFoundError", "param": "lora_path", "code": 404}
    )
    assert error.status_code == 404
    assert error_body(error) == {
        "error": {"message": "m", "type": "NotFoundError", "param": "lora_path", "code": "replica_failed"}
    }
    unreached = FanoutFailed("m", 502, None)
    assert (unreached.status_code, unreached.error_type) == (502, "upstream_error")


def test_remembered_adapters_say_what_each_replica_lacks_until_forgotten() -> None:
    runtime = RuntimeAdapters()
    runtime.remember("llama", "sql", b"{sql}")
    runtime.remember("llama", "chat", b"{chat}")
    assert [a.name for a in runtime.missing("llama", ["sql"])] == ["chat"]
    assert runtime.missing("llama", ["sql", "chat"]) == [] and runtime.missing("qwen", []) == []
    assert runtime.missing("llama", [])[1].body == b"{sql}"  # loaded again as it was loaded
    assert runtime.by_pool() == {"llama": frozenset({"sql", "chat"})}
    assert runtime.forget("llama", "sql") and not runtime.forget("llama", "sql")
    assert runtime.forget("llama", "chat") and runtime.by_pool() == {}


LLAMA = Served("ml", "llama", "llama", ("chat-model",))
SQL = Route("llama", "sql", adapter="sql")


def test_a_remembered_adapter_routes_lists_and_wakes_its_pool_at_zero_like_a_declared_one() -> None:
    fleet, _ = k8s_fleet(LLAMA)
    assert fleet.resolve("sql") == Route("sql", "sql") and "sql" not in fleet.listed_models()
    fleet.runtime_adapters.remember("llama", "sql", b"{}")
    fleet.index_adapters()
    assert fleet.resolve("sql") == SQL and not fleet.is_unserved(SQL)
    assert "sql" in fleet.listed_models() and fleet.model_entry("sql")["parent"] == "llama"
    assert fleet.wake_timeout_s("llama") == 5.0  # its request wakes the pool
    metrics = fleet.metrics.render().decode()
    for tier in ("active", "free_slot", "full"):  # zero series, before any adapter request
        assert f'corral_gateway_adapter_routes_total{{affinity="{tier}",model="llama"}} 0.0' in metrics


def test_a_replica_lacking_a_remembered_adapter_takes_none_of_its_requests_and_is_reported() -> None:
    fleet, _ = k8s_fleet(LLAMA)
    lacking: list[str] = []
    fleet.on_lacking_adapters = lacking.append
    fleet.runtime_adapters.remember("llama", "sql", b"{}")
    fleet.index_adapters()
    set_replicas(fleet, (LLAMA,), [A])
    # Not said yet: unlike a declared adapter, a remembered one is not assumed (not loaded there).
    assert not fleet.has_candidates("llama", adapter="sql")
    fleet.observe_served_names(A, listing("llama"))
    assert lacking == [A]
    # It lists none, yet the request waits for the load rather than getting 404.
    assert not fleet.has_candidates("llama", adapter="sql") and not fleet.is_unserved(SQL)
    fleet.observe_served_names(A, listing("llama", sql="/adapters/sql"))
    assert lacking == [A] and fleet.has_candidates("llama", adapter="sql")


def test_declared_adapters_give_their_pool_zero_series_of_the_affinity_counter() -> None:
    fleet, _ = k8s_fleet(Served("ml", "llama", "llama", adapters=("sql",)), Served("ml", "qwen", "qwen"))
    metrics = fleet.metrics.render().decode()
    assert 'corral_gateway_adapter_routes_total{affinity="full",model="llama"} 0.0' in metrics
    assert 'model="qwen"' not in "".join(
        line for line in metrics.splitlines() if line.startswith("corral_gateway_adapter_routes_total")
    )
