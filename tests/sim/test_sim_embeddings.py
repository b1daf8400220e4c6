"""Simulated embedding models (--runner pooling): /v1/embeddings against a simulated replica (vectors
of the config's hidden size, deterministic, normalized and cut as asked, the engine's 400s), the
runner chosen as the engine chooses it, and each request's time the profile's prefill cost."""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import math
import pathlib
import shutil
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from corral_cli import cmd_engine
from corral_cli.simulate import replica_spec
from corral_engine.demo_encoder import write_demo_encoder
from corral_engine.errors import InvalidRequestError, ModelLoadError
from corral_engine.pooling_params import PoolingParams
from corral_engine.sampling_params import SamplingParams
from corral_engine.server import create_app
from corral_engine.sim.embedding import pseudo_vector, sim_pooling
from corral_engine.sim.engine import NullTokenizer, SimEngine
from corral_engine.sim.host import ReplicaSpec, build_engines
from corral_engine.sim.perf_model import BUILTIN, StepShape
from corral_engine.sim.tokenizer import LightTokenizer

PROFILE = BUILTIN["h100-llama3-8b"]


def _hidden_size(model_dir: pathlib.Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["hidden_size"])


def _spec_args(argv: list[str]) -> ReplicaSpec:
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    args = parser.parse_args(["--simulate", "h100-llama3-8b", *argv])
    return replica_spec(args, cmd_engine.engine_args_from(args))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_demo_encoder(tmp_path_factory.mktemp("sim-bert") / "bert", arch="bert")


@pytest.fixture
def matryoshka_dir(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """The tiny checkpoint's tokenizer and config, naming matryoshka dimensions (no weights)."""
    out = tmp_path / "matryoshka"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [4, 8]}))
    return out


@contextlib.asynccontextmanager
async def _serve(spec: ReplicaSpec, num_replicas: int = 1) -> AsyncIterator[list[httpx.AsyncClient]]:
    """A client for each of `num_replicas` simulated replicas behind the real server."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for engine in build_engines(spec, num_replicas):
            app = create_app(engine)
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            client = httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")
            clients.append(await stack.enter_async_context(client))
        yield clients


def _pooling_spec(model_dir: pathlib.Path, runner: str = "pooling", pooler: str | None = None) -> ReplicaSpec:
    return ReplicaSpec(PROFILE, model_dir, "emb", pooling=sim_pooling(model_dir, runner, pooler, "emb"))


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(path, json={"model": "emb", **body})


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


async def test_embeddings_from_simulated_replicas_are_deterministic_and_unit_length(
    tiny_model_dir: pathlib.Path,
) -> None:
    size = _hidden_size(tiny_model_dir)
    async with _serve(_pooling_spec(tiny_model_dir), 2) as (a, b):
        texts = ["hello world", "the quick brown fox", "hello world"]
        r = await _post(a, "/v1/embeddings", {"input": texts})
        assert r.status_code == 200, r.text
        body = r.json()
        vectors = [item["embedding"] for item in body["data"]]
        assert [item["index"] for item in body["data"]] == [0, 1, 2]
        assert all(len(v) == size and _norm(v) == pytest.approx(1.0) for v in vectors)
        assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        other = (await _post(b, "/v1/embeddings", {"input": "hello world"})).json()["data"][0]["embedding"]
        assert other == vectors[0]  # another replica, the same vector
        raw = (await _post(a, "/v1/embeddings", {"input": "hello world", "normalize": False})).json()
        assert _norm(raw["data"][0]["embedding"]) != pytest.approx(1.0)
        packed = (
            await _post(a, "/v1/embeddings", {"input": "hello world", "encoding_format": "base64"})
        ).json()
        decoded = struct.unpack(f"<{size}f", base64.b64decode(packed["data"][0]["embedding"]))
        assert decoded == pytest.approx(vectors[0], abs=1e-6)


async def test_a_pooling_replica_refuses_what_the_engine_refuses(tiny_model_dir: pathlib.Path) -> None:
    async with _serve(_pooling_spec(tiny_model_dir)) as (client,):
        r = await _post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
        r = await _post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400
        r = await _post(client, "/v1/embeddings", {"input": "hi", "dimensions": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    async with _serve(ReplicaSpec(PROFILE, tiny_model_dir, "emb")) as (client,):  # a generating one
        r = await _post(client, "/v1/embeddings", {"input": "hi"})
        assert r.status_code == 400 and "--runner generate" in r.json()["error"]["message"]


async def test_matryoshka_dimensions_are_honoured_as_the_config_names_them(
    matryoshka_dir: pathlib.Path,
) -> None:
    async with _serve(_pooling_spec(matryoshka_dir)) as (client,):
        full = (await _post(client, "/v1/embeddings", {"input": "hello", "normalize": False})).json()
        r = await _post(client, "/v1/embeddings", {"input": "hello", "dimensions": 8})
        assert r.status_code == 200, r.text
        cut = r.json()["data"][0]["embedding"]
        assert len(cut) == 8 and _norm(cut) == pytest.approx(1.0)
        head = full["data"][0]["embedding"][:8]  # the full vector's first 8, then normalized
        assert cut == pytest.approx([v / _norm(head) for v in head])
        r = await _post(client, "/v1/embeddings", {"input": "hello", "dimensions": 5})
        assert r.status_code == 400 and "[4, 8]" in r.json()["error"]["message"]


def test_the_runner_is_chosen_as_the_engine_chooses_it(
    tiny_model_dir: pathlib.Path, bert_dir: pathlib.Path
) -> None:
    assert sim_pooling(tiny_model_dir, "auto", None, "m") is None  # LlamaForCausalLM generates
    encoder = sim_pooling(bert_dir, "auto", None, "m")
    assert encoder is not None and encoder.is_encoder
    assert encoder.embed.embedding_size == _hidden_size(bert_dir)
    assert encoder.pooler.pooling_type == "MEAN"  # from its sentence-transformers files
    with pytest.raises(ModelLoadError, match="encoder"):
        sim_pooling(bert_dir, "generate", None, "m")
    decoder = sim_pooling(tiny_model_dir, "pooling", '{"pooling_type": "MEAN", "normalize": false}', "m")
    assert decoder is not None and decoder.pooler.pooling_type == "MEAN" and not decoder.pooler.normalize
    spec = _spec_args(["--model", str(tiny_model_dir), "--runner", "pooling"])
    assert spec.pooling is not None and spec.pooling.embed.model_name == spec.served_model_name
    with pytest.raises(ModelLoadError, match="--enable-lora"):
        _spec_args(["--model", str(tiny_model_dir), "--runner", "pooling", "--enable-lora"])


def test_a_classifier_is_not_taken_for_an_embedding_model_and_the_engines_encoders_are_known(
    bert_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """The simulator reads the engine's list of encoders (corral_engine.pooling), so a cross-encoder
    or token classifier checkpoint is not taken for an embedding model: it is simulated as the
    classifier it is, with transformers' two LABEL_i labels where config.json names none."""
    reranker = shutil.copytree(bert_dir, tmp_path / "reranker")
    config = json.loads((reranker / "config.json").read_text())
    for arch, tasks in (
        ("RobertaForSequenceClassification", ("classify",)),
        ("RobertaForTokenClassification", ("token_classify",)),
        ("XLMRobertaForMaskedLM", None),
    ):
        (reranker / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        pooling = sim_pooling(reranker, "auto", None, "m")
        if tasks is None:  # not an encoder the engine serves: the decoder rule (a *ForMaskedLM generates)
            assert pooling is None
            continue
        assert pooling is not None and pooling.embed.tasks == tasks
        assert pooling.embed.labels == ("LABEL_0", "LABEL_1")
        with pytest.raises(ModelLoadError, match="serves scores only"):
            sim_pooling(reranker, "generate", None, "m")


async def test_an_encoder_replica_serves_its_wordpiece_inputs(bert_dir: pathlib.Path) -> None:
    async with _serve(_pooling_spec(bert_dir, "auto")) as (client,):
        r = await _post(client, "/v1/embeddings", {"input": ["hello world", "embeddings for retrieval"]})
        assert r.status_code == 200, r.text
        assert [len(d["embedding"]) for d in r.json()["data"]] == [_hidden_size(bert_dir)] * 2


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _virtual_engine(
    model_dir: pathlib.Path, runner: str = "pooling", **kwargs: Any
) -> tuple[SimEngine, _Clock]:
    clock = _Clock()
    pooling = sim_pooling(model_dir, runner, None, "emb")
    return SimEngine(PROFILE, LightTokenizer(model_dir), "emb", clock=clock, pooling=pooling, **kwargs), clock


def _run(engine: SimEngine, clock: _Clock) -> tuple[list[float], dict[str, float]]:
    """Every step's duration, and when each request ended, on the virtual clock."""
    durations, ended = [], {}
    while (step := engine.begin_step()) is not None:
        assert step.duration_s == PROFILE.step_time_s(StepShape.of(step.scheduled.scheduled))
        clock.now += step.duration_s
        durations.append(step.duration_s)
        for out in engine.finish_step(step):
            assert out.finished and out.outputs == []
            ended[out.request_id] = clock.now
    return durations, ended


def test_each_request_ends_with_its_prompt_at_the_profiles_prefill_cost(tiny_model_dir: pathlib.Path) -> None:
    engine, clock = _virtual_engine(tiny_model_dir)
    for i, n in enumerate((100, 300)):
        engine.add_request(f"r{i}", [5 + i] * n, PoolingParams())
    durations, ended = _run(engine, clock)
    prefill = PROFILE.step_time_s(StepShape(400, 2, 400, 100 * 50.5 + 300 * 150.5))
    assert durations == [pytest.approx(prefill)] and ended == {"r0": prefill, "r1": prefill}
    assert engine.stats().num_prompt_tokens_total == 400
    assert engine.block_manager.num_free_blocks == PROFILE.num_kv_blocks  # blocks freed at the end
    # A prompt longer than the step's budget is chunked, as the engine's decoder pools it.
    small = dataclasses.replace(PROFILE, max_num_batched_tokens=256)
    pooling = sim_pooling(tiny_model_dir, "pooling", None, "emb")
    chunked = SimEngine(small, LightTokenizer(tiny_model_dir), "emb", clock=clock, pooling=pooling)
    chunked.add_request("long", [7] * 600, PoolingParams())
    durations, ended = _run(chunked, clock)
    assert len(durations) == 3 and set(ended) == {"long"}
    with pytest.raises(InvalidRequestError, match="embedding model"):
        engine.add_request("gen", [1, 2, 3], SamplingParams(max_tokens=2))


def test_an_encoders_prompts_run_whole_and_without_a_prefix_cache(bert_dir: pathlib.Path) -> None:
    engine, clock = _virtual_engine(bert_dir, "auto")
    assert not engine.block_manager.enable_prefix_caching
    assert not engine.scheduler.config.can_chunk_prompts
    engine.add_request("a", [5] * 20, PoolingParams())
    _, ended = _run(engine, clock)
    assert set(ended) == {"a"}


def test_the_builtin_embedding_profile_serves_an_encoder_its_512_positions(bert_dir: pathlib.Path) -> None:
    profile = BUILTIN["h100-bge-large"]
    pooling = sim_pooling(bert_dir, "auto", None, "bge")
    engine = SimEngine(profile, LightTokenizer(bert_dir), "bge", clock=_Clock(), pooling=pooling)
    for i in range(16):
        engine.add_request(f"r{i}", [5] * 512, PoolingParams())  # whole, 16 in one step
    with pytest.raises(InvalidRequestError, match="512"):
        engine.add_request("long", [5] * 513, PoolingParams())
    step = engine.begin_step()
    assert step is not None and step.shape.num_seqs == 16
    assert 0.005 < step.duration_s < 0.02  # compute-bound: 2 x 335M x 8192 FLOPs at 60 % of 989 TFLOP/s
    assert len(engine.finish_step(step)) == 16


def test_a_lean_engine_replays_embedding_traffic_without_vectors(tiny_model_dir: pathlib.Path) -> None:
    clock = _Clock()
    pooling = sim_pooling(tiny_model_dir, "pooling", None, "emb")
    engine = SimEngine(PROFILE, NullTokenizer(), "emb", clock=clock, is_lean=True, pooling=pooling)
    engine.insert_request(engine.make_request("a", [1, 2, 3], PoolingParams()))
    step = engine.begin_step()
    assert step is not None
    [out] = engine.finish_step(step)
    assert out.finished and out.embedding is None and not engine.has_unfinished_requests()


def test_pseudo_vectors_depend_on_the_ids_only() -> None:
    assert pseudo_vector([1, 2, 3], 16, True, None) == pseudo_vector([1, 2, 3], 16, True, None)
    assert pseudo_vector([1, 2, 3], 16, False, None) != pseudo_vector([3, 2, 1], 16, False, None)
    assert pseudo_vector([1, 2, 3], 16, False, 4) == pseudo_vector([1, 2, 3], 16, False, None)[:4]
