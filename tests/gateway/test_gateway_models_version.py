"""A replica whose responses carry a new models version (a Corral engine with LoRA on that loaded or
unloaded an adapter) has its model list read again at once, not at the next periodic read."""

from __future__ import annotations

from tests.gateway.conftest import FakeEngine
from tests.gateway.test_gateway_proxy import eventually, fleet, replicas


async def test_an_adapter_loaded_on_a_replica_listing_none_routes_at_once() -> None:
    engine = FakeEngine(health_has_load=True, models_version="v1")  # its /health polls carry it
    async with fleet([engine]) as (client, urls):

        async def status(model: str) -> int:
            return (await client.post("/v1/completions", json={"model": model, "prompt": "x"})).status_code

        async def is_listed() -> bool:
            return (await replicas(client))[urls[0]]["served_names"] == ["m"]

        async def has_polled() -> bool:
            return engine.num_health_polls > num_polls + 5

        async def sql_routes() -> bool:
            return await status("sql") == 200

        async def sql_is_gone() -> bool:
            return await status("sql") == 404

        await eventually(is_listed)
        num_polls = engine.num_health_polls
        await eventually(has_polled)
        assert engine.num_model_lists == 1  # the same version: nothing to read again
        # Loaded at run time; the periodic read of a replica listing no adapter is a minute away.
        engine.adapters, engine.models_version = {"sql": "/adapters/sql"}, "v2"
        await eventually(sql_routes)
        engine.adapters, engine.models_version = {}, "v3"
        await eventually(sql_is_gone)


async def test_a_new_version_on_a_proxied_response_has_the_list_read() -> None:
    engine = FakeEngine(models_version="v1")  # no load headers on /health: only responses say it
    async with fleet([engine]) as (client, urls):

        async def is_listed() -> bool:
            return (await replicas(client))[urls[0]]["served_names"] == ["m"]

        async def is_sql_listed() -> bool:
            return (await replicas(client))[urls[0]]["adapters"] == ["sql"]

        await eventually(is_listed)
        engine.adapters, engine.models_version = {"sql": "/adapters/sql"}, "v2"
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 200
        await eventually(is_sql_listed)
        assert (await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})).status_code == 200
