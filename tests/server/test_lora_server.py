"""LoRA adapters through the server, reached by the official `openai` client: /v1/models lists
them under the base model, a request naming one generates with it, vLLM's load and unload
endpoints, and the `vllm:lora_requests_info` gauge; in one process and with the engine core in
its own."""

from __future__ import annotations

import pathlib

import openai
import pytest
from corral_engine import wire
from corral_engine.demo_adapter import write_demo_adapter
from corral_engine.lora import AdapterRegistry, startup_adapters
from corral_engine.settings import EngineSettings
from prometheus_client.parser import text_string_to_metric_families

from tests.server.real_engine import openai_client

BASE = "tiny"
MESSAGES = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "sql", rank=8, seed=3)


def _served(model_dir: pathlib.Path, modules: tuple[str, ...], runtime: bool, engine_process: str = "0"):  # type: ignore[no-untyped-def]
    registry = AdapterRegistry(startup_adapters(modules))
    return openai_client(
        model_dir,
        settings=EngineSettings(engine_process=engine_process),  # type: ignore[arg-type]
        app_kwargs={"adapters": registry, "allow_runtime_lora_updating": runtime},
        served_model_name=BASE,
        enable_lora=True,
        lora_modules=modules or None,
    )


async def _chat(client: openai.AsyncOpenAI, model: str) -> str:
    reply = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.model == model
    return reply.choices[0].message.content or ""


async def test_listed_adapter_generates_differently_from_the_base(
    tiny_model_dir: pathlib.Path, adapter: pathlib.Path
) -> None:
    async with _served(tiny_model_dir, (f"sql={adapter}",), runtime=False) as client:
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {BASE, "sql"}
        sql, base_card = models["sql"].model_extra or {}, models[BASE].model_extra or {}
        assert (sql["parent"], sql["root"], base_card["parent"]) == (BASE, str(adapter), None)
        base, tuned = await _chat(client, BASE), await _chat(client, "sql")
        assert base != tuned
        assert await _chat(client, "sql") == tuned  # greedy: the same again
        stream = await client.completions.create(
            model="sql", prompt="fox", max_tokens=4, temperature=0, stream=True
        )
        assert {chunk.model async for chunk in stream} == {"sql"}
        response = await client.responses.create(model="sql", input="fox", max_output_tokens=4, temperature=0)
        assert response.model == "sql"
        with pytest.raises(openai.NotFoundError):
            await _chat(client, "nope")
        # Without runtime updating the endpoints are unknown routes.
        http = client._client  # the ASGI transport's httpx client
        response = await http.post(
            "http://127.0.0.1/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"}
        )
        assert response.status_code == 404
        metrics = (await http.get("http://127.0.0.1/metrics")).text
        (family,) = [f for f in text_string_to_metric_families(metrics) if f.name == wire.LORA_REQUESTS_INFO]
        (sample,) = family.samples
        assert sample.labels == {
            wire.LORA_MAX_LABEL: "4",
            wire.LORA_RUNNING_LABEL: "",
            wire.LORA_WAITING_LABEL: "",
        }
        assert sample.value > 1.7e9  # a Unix time


@pytest.mark.parametrize("engine_process", ["0", "1"], ids=["one-process", "core-process"])
async def test_load_and_unload_endpoints(
    tiny_model_dir: pathlib.Path, adapter: pathlib.Path, tmp_path: pathlib.Path, engine_process: str
) -> None:
    async with _served(tiny_model_dir, (), runtime=True, engine_process=engine_process) as client:
        http = client._client
        base = await _chat(client, BASE)
        load = "http://127.0.0.1/v1/load_lora_adapter"
        response = await http.post(load, json={"lora_name": "sql", "lora_path": str(adapter)})
        assert response.status_code == 200 and "sql" in response.text
        assert "sql" in {m.id for m in (await client.models.list()).data}
        assert await _chat(client, "sql") != base
        again = await http.post(load, json={"lora_name": "sql", "lora_path": str(adapter)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = await http.post(load, json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400
        assert "adapter 'bad'" in bad.json()["error"]["message"]
        assert (await http.post(load, json={"lora_name": "x"})).status_code == 400
        unload = "http://127.0.0.1/v1/unload_lora_adapter"
        assert (await http.post(unload, json={"lora_name": "sql"})).status_code == 200
        assert (await http.post(unload, json={"lora_name": "sql"})).status_code == 404
        with pytest.raises(openai.NotFoundError):
            await _chat(client, "sql")
        assert await _chat(client, BASE) == base
