"""LoRA adapters through the gateway, with real engine processes and the official openai client: an
adapter one replica serves is listed by the gateway under its base model, its requests go to that
replica only and answer as the replica does directly, and an adapter loaded (and unloaded) at run
time comes and goes from the gateway's routes, on a replica that listed none within seconds too; one
loaded through the gateway reaches every replica, a replica started later too, or none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from corral_engine.demo_adapter import write_demo_adapter

from e2e.gateway.conftest import MODEL, replica_state, restart_engine, start_gateway, wait_for
from e2e.procs import HOST, EngineProcess, ManagedProcess, free_port, start_engine

PROMPT = "one two three four"


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_demo_adapter(tiny_model_dir, root / name, seed=seed)
        for seed, name in enumerate(("sql", "late", "fresh"))
    }


LORA = {"enable_lora": True, "allow_runtime_lora_updating": True}


@pytest.fixture(scope="module")
def fleet(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ManagedProcess, EngineProcess, EngineProcess]]:
    """Replica `with_sql` serves adapter sql from its start; `plain` none (runtime loading on)."""
    lora = {"served_model_name": MODEL, **LORA}
    with (
        start_engine(tiny_model_dir, lora_modules=f"sql={adapter_dirs['sql']}", **lora) as with_sql,
        start_engine(tiny_model_dir, **lora) as plain,
        start_gateway({MODEL: [with_sql.url, plain.url]}, tmp_path_factory.mktemp("gateway")) as gateway,
    ):
        yield gateway, with_sql, plain


def _complete(base_url: str, model: str) -> str:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0)
    assert reply.model == model
    return reply.choices[0].text


def _successes(engine: EngineProcess) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def test_an_adapter_is_listed_and_served_by_the_replica_that_has_it(
    fleet: tuple[ManagedProcess, EngineProcess, EngineProcess],
) -> None:
    gateway, with_sql, plain = fleet
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    wait_for("sql listed", lambda: "sql" in {m.id for m in client.models.list()})
    sql = client.models.retrieve("sql")
    assert sql.model_extra is not None and sql.model_extra["parent"] == MODEL
    direct = _complete(with_sql.url, "sql")
    assert direct != _complete(with_sql.url, MODEL)  # the adapter changes the greedy text
    plain_before = _successes(plain)
    for _ in range(6):
        assert _complete(gateway.url, "sql") == direct
    assert _successes(plain) == plain_before  # never sent to the replica without the adapter
    with pytest.raises(openai.NotFoundError):
        _complete(gateway.url, "late")


def test_an_adapter_loaded_at_run_time_becomes_routable(
    fleet: tuple[ManagedProcess, EngineProcess, EngineProcess], adapter_dirs: dict[str, Path]
) -> None:
    gateway, with_sql, _ = fleet
    body = {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}
    assert httpx.post(with_sql.url + "/v1/load_lora_adapter", json=body, timeout=30).status_code == 200
    direct = _complete(with_sql.url, "late")
    # A replica that lists adapters has its model list read every few seconds.
    wait_for("late listed", lambda: "late" in replica_state(gateway)[with_sql.url]["adapters"], 30)
    assert _complete(gateway.url, "late") == direct
    unload = httpx.post(with_sql.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
    assert unload.status_code == 200
    wait_for("late gone", lambda: "late" not in replica_state(gateway)[with_sql.url]["adapters"], 30)
    with pytest.raises(openai.NotFoundError):
        _complete(gateway.url, "late")


def test_an_adapter_loaded_on_a_replica_listing_none_routes_within_seconds(
    fleet: tuple[ManagedProcess, EngineProcess, EngineProcess], adapter_dirs: dict[str, Path]
) -> None:
    gateway, _, plain = fleet
    wait_for("plain's list read", lambda: replica_state(gateway)[plain.url]["served_names"] is not None)
    body = {"lora_name": "fresh", "lora_path": str(adapter_dirs["fresh"])}
    assert httpx.post(plain.url + "/v1/load_lora_adapter", json=body, timeout=30).status_code == 200
    direct = _complete(plain.url, "fresh")
    # Its list is read again as soon as its load headers carry a new models version, not at the
    # periodic read a minute away that a replica listing no adapter gets.
    wait_for("fresh listed", lambda: "fresh" in replica_state(gateway)[plain.url]["adapters"], 15)
    assert _complete(gateway.url, "fresh") == direct
    unload = httpx.post(plain.url + "/v1/unload_lora_adapter", json={"lora_name": "fresh"}, timeout=30)
    assert unload.status_code == 200
    wait_for("fresh gone", lambda: "fresh" not in replica_state(gateway)[plain.url]["adapters"], 15)


def _listed(engine: EngineProcess) -> set[str]:
    """What the replica itself lists in its /v1/models."""
    return {m["id"] for m in httpx.get(engine.url + "/v1/models", timeout=5).json()["data"]}


def _chat(client: openai.OpenAI, model: str, i: int) -> None:
    messages = [{"role": "user", "content": f"say {i}"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.0)
    assert reply.model == model


def test_an_adapter_loaded_through_the_gateway_reaches_every_replica_a_later_one_too_or_none(
    fleet: tuple[ManagedProcess, EngineProcess, EngineProcess],
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _, with_sql, plain = fleet
    root = tmp_path_factory.mktemp("fanout-adapters")
    fan = write_demo_adapter(tiny_model_dir, root / "fan", rank=8, seed=7)
    wide = write_demo_adapter(tiny_model_dir, root / "wide", rank=16, seed=8)
    late_port = free_port()  # a replica not started yet: it is given the adapter once it is up
    late_url = f"http://{HOST}:{late_port}"
    backends = {MODEL: [with_sql.url, plain.url, late_url]}
    settings = {"policy": "round-robin", "ejection_s": 0.5, "max_ejection_s": 1.0}
    with start_gateway(backends, tmp_path_factory.mktemp("fanout-gateway"), **settings) as gateway:
        ready = (with_sql.url, plain.url)
        wait_for(
            "lists read", lambda: all(replica_state(gateway)[u]["served_names"] is not None for u in ready)
        )
        body = {"lora_name": "fan", "lora_path": str(fan), "base_model_name": MODEL}
        loaded = httpx.post(gateway.url + "/v1/load_lora_adapter", json=body, timeout=120)
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'fan' added successfully."
        assert "fan" in _listed(with_sql) and "fan" in _listed(plain)
        # Routable at once, to both replicas.
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        before = {e.url: _successes(e) for e in (with_sql, plain)}
        for i in range(12):
            _chat(client, "fan", i)
            if all(_successes(e) > before[e.url] for e in (with_sql, plain)):
                break
        assert all(_successes(e) > before[e.url] for e in (with_sql, plain))
        with restart_engine(tiny_model_dir, late_port, **LORA, max_lora_rank=8) as late:
            wait_for("late given fan", lambda: "fan" in replica_state(gateway)[late_url]["adapters"], 120)
            assert "fan" in _listed(late)
            # `wide` (rank 16) loads on the first two, not on `late` (--max-lora-rank 8): undone.
            failed = httpx.post(
                gateway.url + "/v1/load_lora_adapter",
                json={"lora_name": "wide", "lora_path": str(wide)},
                timeout=120,
            )
            assert failed.status_code == 400, failed.text
            error = failed.json()["error"]
            assert f"1 of 3 replicas of `{MODEL}` ({late_url}: HTTP 400" in error["message"]
            assert error["param"] == "lora_path"
            assert all("wide" not in _listed(e) for e in (with_sql, plain, late))
            with pytest.raises(openai.NotFoundError):
                _chat(client, "wide", 0)
            unloaded = httpx.post(
                gateway.url + "/v1/unload_lora_adapter", json={"lora_name": "fan"}, timeout=120
            )
            assert unloaded.status_code == 200, unloaded.text
            assert all("fan" not in _listed(e) for e in (with_sql, plain, late))
            with pytest.raises(openai.NotFoundError):
                _chat(client, "fan", 0)
