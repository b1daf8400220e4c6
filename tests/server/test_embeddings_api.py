"""POST /v1/embeddings on a real pooling engine, through the official `openai` client: base64 (the
client's default) and float vectors, batched, text and token-id inputs, the engine core in its own
process; OpenAI-shaped errors; the generation routes refused on an embedding model, and the
embeddings route on a generating one; the metrics a pooling request moves; a client that leaves
aborts its inputs."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from corral_engine import AsyncEngine, EngineArgs, EngineCoreClient
from corral_engine.demo_embedding import make_embedding_model
from corral_engine.server import create_app
from corral_engine.server.api_embeddings import encode_vector
from corral_engine.settings import EngineSettings
from prometheus_client.parser import text_string_to_metric_families

from tests.server.asgi_call import AsgiCall

MODEL = "qwen3-embedding"


@pytest.fixture(scope="module")
def embedding_dir(tiny_model_dirs, tmp_path_factory) -> pathlib.Path:  # type: ignore[no-untyped-def]
    dst = shutil.copytree(tiny_model_dirs["qwen3"], tmp_path_factory.mktemp("emb") / MODEL)
    return make_embedding_model(dst, "lasttoken")


@contextlib.asynccontextmanager
async def serve(
    model_dir: pathlib.Path, settings: EngineSettings | None = None, **args: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    engine_args = EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=256, **args)
    engine: AsyncEngine | EngineCoreClient
    if settings is not None and settings.engine_process == "1":
        engine = EngineCoreClient(engine_args, settings=settings)
    else:
        engine = AsyncEngine(engine_args, settings=settings)
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0
            )
            yield client, http


def _norm(vector: list[float]) -> float:
    return float(sum(x * x for x in vector)) ** 0.5


@pytest.mark.parametrize("in_own_process", [False, True], ids=["one-process", "engine-core-process"])
async def test_the_openai_client_gets_vectors(embedding_dir: pathlib.Path, in_own_process: bool) -> None:
    settings = EngineSettings(engine_process="1") if in_own_process else None
    texts = ["hello world", "the quick brown fox", "a"]
    async with serve(embedding_dir, settings, runner="pooling") as (client, _):
        alone = [
            (await client.embeddings.create(model=MODEL, input=t, encoding_format="float")).data[0]
            for t in texts
        ]
        batched = await client.embeddings.create(model=MODEL, input=texts)  # base64, the client's default
        as_floats = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
        ids = [[5, 6, 7, 8], [9, 10]]
        by_ids = await client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
        one_ids = await client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert [d.index for d in batched.data] == [0, 1, 2]
    assert batched.object == "list" and batched.model == MODEL and batched.data[0].object == "embedding"
    for a, b, f in zip(alone, batched.data, as_floats.data, strict=True):
        assert len(b.embedding) == 64 and abs(_norm(b.embedding) - 1.0) < 1e-5
        assert b.embedding == pytest.approx(f.embedding, abs=1e-6)  # base64 decodes to the floats
        assert b.embedding == pytest.approx(a.embedding, abs=1e-5)  # batched or alone
    assert batched.usage.prompt_tokens == batched.usage.total_tokens > len(texts)
    assert by_ids.usage.prompt_tokens == 6
    assert by_ids.data[0].embedding == pytest.approx(one_ids.data[0].embedding, abs=1e-5)


async def test_raw_response_shapes(embedding_dir: pathlib.Path) -> None:
    async with serve(embedding_dir, runner="pooling") as (_, http):
        body = {"model": MODEL, "input": [[5, 6, 7]], "encoding_format": "base64", "normalize": False}
        raw = (await http.post("/v1/embeddings", json=body)).json()
        floats = (await http.post("/v1/embeddings", json={**body, "encoding_format": "float"})).json()
        models = (await http.get("/v1/models")).json()
    assert raw["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert raw["id"].startswith("embd-") and raw["object"] == "list"
    assert raw["data"][0]["embedding"] == encode_vector(floats["data"][0]["embedding"], "base64")
    assert abs(_norm(floats["data"][0]["embedding"]) - 1.0) > 1e-3  # normalize false: as pooled
    assert [m["id"] for m in models["data"]] == [MODEL]


async def _error(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await call
    return caught.value


async def test_errors_are_openai_shaped(embedding_dir: pathlib.Path) -> None:
    async with serve(embedding_dir, runner="pooling", max_model_len=64) as (client, http):
        cases = {
            "empty list": (client.embeddings.create(model=MODEL, input=[]), "input"),
            "empty string": (client.embeddings.create(model=MODEL, input=""), "input"),
            "an empty one": (client.embeddings.create(model=MODEL, input=["a", ""]), "input"),
            "too long": (client.embeddings.create(model=MODEL, input=list(range(3, 70))), "input"),
            "dimensions": (client.embeddings.create(model=MODEL, input="a", dimensions=16), "dimensions"),
        }
        errors = {name: (await _error(call), param) for name, (call, param) in cases.items()}
        truncated = await client.embeddings.create(
            model=MODEL, input=list(range(3, 70)), extra_body={"truncate_prompt_tokens": -1}
        )
        completion = await _error(client.completions.create(model=MODEL, prompt="hi", max_tokens=2))
        chat = await _error(
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        )
        responses = await http.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    for name, (error, param) in errors.items():
        assert error.status_code == 400, name
        assert isinstance(error.body, dict) and error.body["type"] == "invalid_request_error", name
        assert error.body["param"] == param, name
    assert "maximum context length is 64" in errors["too long"][0].body["message"]  # type: ignore[index]
    assert truncated.usage.prompt_tokens == 64
    for refused in (completion, chat):
        assert refused.status_code == 400 and "/v1/embeddings" in refused.body["message"]  # type: ignore[index]
    assert responses.status_code == 400 and "--runner pooling" in responses.json()["error"]["message"]


async def test_a_generating_engine_refuses_embeddings(tiny_model_dir: pathlib.Path) -> None:
    async with serve(tiny_model_dir) as (client, _):
        error = await _error(client.embeddings.create(model=tiny_model_dir.name, input="hello"))
    assert error.status_code == 400
    assert "does not support the Embeddings API" in error.body["message"]  # type: ignore[index]


async def test_metrics_count_prompts_and_successes(embedding_dir: pathlib.Path) -> None:
    async with serve(embedding_dir, runner="pooling") as (client, http):
        await client.embeddings.create(model=MODEL, input=[[5, 6, 7], [8, 9]])
        text = (await http.get("/metrics")).text
    assert _sample(text, "vllm:prompt_tokens_total") == 5
    assert _sample(text, "vllm:request_success_total", finished_reason="stop") == 2
    assert _sample(text, "vllm:e2e_request_latency_seconds_count") == 2
    assert _sample(text, "vllm:request_prompt_tokens_count") == 2
    assert _sample(text, "vllm:request_generation_tokens_count") == 0
    assert _sample(text, "vllm:time_to_first_token_seconds_count") == 0


def _sample(text: str, name: str, **labels: str) -> float:
    (value,) = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    return float(value)


async def test_a_client_that_leaves_aborts_its_inputs(embedding_dir: pathlib.Path) -> None:
    """Prompts of hundreds of one-token steps: the client hangs up while they run, and both engine
    requests are aborted, their blocks freed."""
    args = EngineArgs(model=str(embedding_dir), dtype="float32", num_kv_blocks=64, runner="pooling")
    engine = AsyncEngine(args.replace(max_num_batched_tokens=1))
    app = create_app(engine)
    call = AsgiCall(app, {"model": MODEL, "input": [list(range(3, 400)), list(range(3, 300))]})
    bm = engine.engine.block_manager
    async with app.router.lifespan_context(app):
        task = asyncio.create_task(call.run("/v1/embeddings"))
        for _ in range(500):
            if bm.num_free_blocks < bm.num_blocks:  # the first prompt's chunks are running
                break
            await asyncio.sleep(0.01)
        assert engine.engine.requests
        call.hang_up.set()
        await asyncio.wait_for(task, 20)
        for _ in range(500):
            if not engine.engine.requests and bm.num_free_blocks == bm.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.requests and bm.num_free_blocks == bm.num_blocks
        assert engine.engine.stats().finished_by_reason == {"abort": 2}
    assert call.sent[0]["status"] == 499
