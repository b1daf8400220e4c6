"""What the gateway tells monitors about its replicas: a model's last replica failing stays in rotation
but shows unhealthy (gauge, /health, /corral/replicas), and so does one serving another model name."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from pathlib import Path

import httpx
import pytest
import uvicorn
from corral_gateway import replica_poller
from corral_gateway.fleet import Fleet
from corral_gateway.k8s_discovery import Discovery
from corral_gateway.k8s_names import Served, naming
from corral_gateway.metrics import GatewayMetrics
from corral_gateway.served_names import parse_model_ids
from corral_gateway.settings import GatewaySettings
from pydantic import ValidationError

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import dead_url, eventually, fleet, replicas


def gauge(metrics_text: str, name: str, url: str) -> float:
    match = re.search(rf'^{name}{{model="m",replica="{re.escape(url)}"}} (\S+)$', metrics_text, re.M)
    assert match is not None, name
    return float(match.group(1))


async def state(client: httpx.AsyncClient, url: str) -> dict[str, object]:
    return (await replicas(client))[url]


async def test_a_dead_last_replica_shows_unhealthy_while_requests_still_try_it() -> None:
    dead = dead_url()
    async with fleet([], extra_urls=[dead], queue_timeout_s=1) as (client, _):

        async def is_unhealthy() -> bool:
            return (await state(client, dead))["healthy"] is False

        await eventually(is_unhealthy)
        assert (await state(client, dead))["ejected"] is False  # the model's last one: kept
        health = await client.get("/health")
        assert health.status_code == 200  # the gateway itself is alive (a liveness probe)
        assert health.json() == {"status": "degraded", "models": ["m"], "models_down": ["m"]}
        metrics = (await client.get("/metrics")).text
        assert gauge(metrics, "corral_gateway_replica_healthy", dead) == 0.0
        assert f'corral_gateway_ejections_total{{replica="{dead}"}} 0.0' in metrics
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code >= 500
        metrics = (await client.get("/metrics")).text
        # Its only replica: tried again after a back-off on each of the 3 attempts.
        assert 'corral_gateway_retries_total{model="m",reason="connect_error"} 3.0' in metrics
        # A replica up on that address again: healthy once it answers a poll, no request needed.
        revived = FakeEngine(name="revived")
        port = int(dead.rsplit(":", 1)[1])
        config = uvicorn.Config(revived.app(), host="127.0.0.1", port=port, log_level="critical")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        try:

            async def is_healthy() -> bool:
                return (await state(client, dead))["healthy"] is True

            await eventually(is_healthy)
            assert (await client.get("/health")).json()["status"] == "ok"
            assert gauge((await client.get("/metrics")).text, "corral_gateway_replica_healthy", dead) == 1.0
        finally:
            server.should_exit = True
            await task


async def test_a_last_replica_whose_health_check_fails_shows_unhealthy() -> None:
    # Corral's engine answers /health with 503 (and its load headers) while starting, draining, or
    # once its engine loop died; a sole replica's 5xx answers to requests do not count.
    engine = FakeEngine(is_healthy=False, health_has_load=True)
    async with fleet([engine]) as (client, urls):

        async def is_healthy() -> bool:
            return bool((await state(client, urls[0]))["healthy"])

        await eventually(lambda: _negate(is_healthy))
        assert (await client.get("/health")).json()["models_down"] == ["m"]
        engine.is_healthy = True
        await eventually(is_healthy)
        assert (await client.get("/health")).json()["models_down"] == []


async def test_a_wedged_replica_is_ejected_and_requests_go_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped process (SIGSTOP, a deadlock) whose kernel still accepts connections: its /health
    polls go unanswered. Left in rotation, it showed healthy and took a share of the requests,
    each waiting first_byte_timeout_s (300 s by default) for nothing."""
    monkeypatch.setattr(replica_poller, "_POLL_READ_TIMEOUT_S", 0.1)
    with socket.socket() as wedged:
        wedged.bind(("127.0.0.1", 0))
        wedged.listen(64)  # connections are taken by the kernel, never answered
        url = f"http://127.0.0.1:{wedged.getsockname()[1]}"
        async with fleet([FakeEngine()], extra_urls=[url], eject_after_failures=2) as (client, _):

            async def is_ejected() -> bool:
                return (await state(client, url))["ejected"] is True

            await eventually(is_ejected)
            assert (await state(client, url))["healthy"] is False
            body = {"model": "m", "prompt": "x"}
            for _ in range(4):
                response = await client.post("/v1/completions", json=body, timeout=5)
                assert response.status_code == 200


async def _negate(predicate: object) -> bool:
    assert callable(predicate)
    return not await predicate()


async def test_a_replica_serving_another_name_is_flagged_once_and_kept_in_rotation(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(replica_poller, "_NAMES_CHECK_INTERVAL_S", 0.05)  # read its list often
    engine = FakeEngine(served_names=("model",))  # `--backend m=URL` in front of `model`
    async with fleet([engine]) as (client, urls):
        url = urls[0]

        async def is_misnamed() -> bool:
            return (await state(client, url))["serves_model"] is False

        await eventually(is_misnamed)
        replica = await state(client, url)
        assert replica["served_names"] == ["model"] and replica["healthy"] is False
        assert replica["ejected"] is False
        assert (await client.get("/health")).json() == {
            "status": "degraded",
            "models": ["m"],
            "models_down": ["m"],
        }
        assert gauge((await client.get("/metrics")).text, "corral_gateway_replica_healthy", url) == 0.0
        num_lists = engine.num_model_lists
        await eventually(lambda: _at_least(engine, num_lists + 3))  # read again, unchanged
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        flagged = [w for w in warnings if "serves 'model', not 'm'" in w]
        assert len(flagged) == 1 and url in flagged[0] and "backend 'm'" in flagged[0], warnings
        # Kept in rotation: requests get what the replica answers (an engine's 404, here a fake's 200).
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 200
        engine.served_names = ("m", "model")  # renamed: now it serves the routed name too

        async def serves() -> bool:
            return (await state(client, url))["serves_model"] is True

        await eventually(serves)
        assert (await state(client, url))["healthy"] is True
        assert (await client.get("/health")).json()["status"] == "ok"


async def _at_least(engine: FakeEngine, num_lists: int) -> bool:
    return engine.num_model_lists >= num_lists


def test_discovered_pools_are_checked_against_the_name_their_requests_carry() -> None:
    # A name served in two namespaces is pooled as NAMESPACE/NAME; the engine serves NAME.
    fleet = Fleet(GatewaySettings(kubernetes={"enabled": True}), GatewayMetrics())
    names = naming([Served("team-a", "x", "llama"), Served("team-b", "y", "llama")])
    pools = {"team-a/llama": ["http://a"], "team-b/llama": ["http://b"], "asleep": []}
    fleet.apply_discovery(Discovery(pools, {}, names))
    assert fleet.upstream_name("team-a/llama") == "llama"
    fleet.observe_served_names("http://a", {"llama": {}})
    fleet.observe_served_names("http://b", {"qwen": {}})
    snapshot = fleet.snapshot()
    assert [(r["serves_model"], r["healthy"]) for r in snapshot["team-a/llama"]] == [(True, True)]
    assert [(r["serves_model"], r["healthy"]) for r in snapshot["team-b/llama"]] == [(False, False)]
    assert fleet.models_down() == ["team-b/llama"]  # a model at zero replicas is not down


async def test_the_model_list_is_asked_for_with_the_upstream_key() -> None:
    engine = FakeEngine()
    async with fleet([engine], upstream_api_key="sk-upstream") as (client, urls):

        async def is_known() -> bool:
            return (await state(client, urls[0]))["serves_model"] is True

        await eventually(is_known)
        assert engine.models_authorization == "Bearer sk-upstream"


@pytest.mark.parametrize(
    ("body", "ids"),
    [
        (b'{"object": "list", "data": [{"id": "b"}, {"id": "a"}, {"id": "a"}]}', ("a", "b")),
        (b'{"object": "list", "data": []}', ()),
        (b'{"data": [{"id": 3}, "x", {"id": "ok"}]}', ("ok",)),
        (b'{"error": {"message": "unauthorized"}}', None),
        (b"not json", None),
        (b"\xff\xfe", None),
        (b"[1, 2]", None),
    ],
)
def test_model_ids_are_read_from_an_openai_model_list(body: bytes, ids: tuple[str, ...] | None) -> None:
    assert parse_model_ids(body) == ids


async def test_the_gateways_model_list_carries_what_its_replicas_say() -> None:
    async with fleet([FakeEngine()]) as (client, urls):

        async def is_known() -> bool:
            return (await state(client, urls[0]))["serves_model"] is True

        await eventually(is_known)
        listed = (await client.get("/v1/models")).json()["data"]
        card = {
            "id": "m",
            "object": "model",
            "created": 1700000000,
            "owned_by": "fake",
            "max_model_len": 4096,
        }
        assert listed == [card]
        assert (await client.get("/v1/models/m")).json() == card


def test_an_alias_is_listed_with_its_pools_card_and_an_unread_pool_with_defaults() -> None:
    fleet = Fleet(GatewaySettings(kubernetes={"enabled": True}), GatewayMetrics())
    names = naming([Served("team-a", "x", "llama", ("chat",))])
    fleet.apply_discovery(Discovery({"llama": ["http://a"], "other": ["http://b"]}, {}, names))
    fleet.observe_served_names("http://a", {"llama": {"max_model_len": 8192, "created": 5}})
    assert fleet.model_entry("chat") == {
        "id": "chat", "object": "model", "created": 5, "owned_by": "corral", "max_model_len": 8192
    }  # fmt: skip
    assert fleet.model_entry("other") == {
        "id": "other",
        "object": "model",
        "created": 0,
        "owned_by": "corral",
    }


async def test_probes_name_the_models_only_to_a_caller_with_a_key(tmp_path: Path) -> None:
    """With API keys, /v1/models needs one; /health and /ready (open to probes) listed the same
    names, and models_down, to anyone. Without a key they now say only their status."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-good\n")
    async with fleet([FakeEngine()], api_keys_file=keys) as (client, _):
        assert (await client.get("/v1/models")).status_code == 401
        health, ready = await client.get("/health"), await client.get("/ready")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        wrong = await client.get("/health", headers={"authorization": "Bearer sk-bad"})
        assert wrong.json() == {"status": "ok"}
        auth = {"authorization": "Bearer sk-good"}
        health = await client.get("/health", headers=auth)
        assert health.json() == {"status": "ok", "models": ["m"], "models_down": []}
        assert (await client.get("/ready", headers=auth)).json() == {"status": "ready", "models": ["m"]}


async def test_metrics_stay_open_to_a_keyless_scrape_by_default(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-good\n")
    async with fleet([FakeEngine()], api_keys_file=keys) as (client, _):
        assert (await client.get("/metrics")).status_code == 200


async def test_metrics_require_auth_answers_only_a_key(tmp_path: Path) -> None:
    """/metrics names the models, the keys and the replicas' addresses; an Ingress reaches it."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-good\n")
    async with fleet([FakeEngine()], api_keys_file=keys, metrics_require_auth=True) as (client, _):
        for headers in ({}, {"authorization": "Bearer sk-bad"}):
            refused = await client.get("/metrics", headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "invalid_request_error"
            assert "corral_gateway" not in refused.text
        scraped = await client.get("/metrics", headers={"authorization": "Bearer sk-good"})
        assert scraped.status_code == 200 and "corral_gateway_requests_total" in scraped.text
        assert (await client.get("/health")).status_code == 200  # probes stay keyless


def test_metrics_require_auth_needs_a_keys_file() -> None:
    with pytest.raises(ValidationError, match="metrics_require_auth needs api_keys_file"):
        GatewaySettings(metrics_require_auth=True)
