"""`corral engine --model hf://...` and `s3://...` against the loopback Hub stand-in and moto S3:
the engine fetches into the cache, serves a chat completion to the official openai client under the
URI's name, starts again from the cache with the source gone, and never logs a credential."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.procs import EngineProcess, free_port, start_engine
from tests.sources.conftest import BUCKET, HF_TOKEN, PREFIX
from tests.sources.hub_standin import HubStandIn, Repo
from tests.sources.s3_server import S3Server, moto_s3

pytestmark = [pytest.mark.e2e]

FLAGS: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 4}
CHAT: Any = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def hub(tiny_model_dir: Path) -> Iterator[HubStandIn]:
    with HubStandIn({"org/tiny-chat": Repo(tiny_model_dir, tokens={HF_TOKEN: 200})}) as standin:
        yield standin


@pytest.fixture(scope="module")
def s3(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with moto_s3(tmp_path_factory.mktemp("moto-logs")) as server:
        server.upload_dir(BUCKET, PREFIX, tiny_model_dir)
        yield server


def chat(engine: EngineProcess, model: str) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [model]
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
    assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens > 0


def test_two_replicas_on_one_cache_download_once_then_restart_offline(
    hub: HubStandIn, tmp_path: Path
) -> None:
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": HF_TOKEN,
        "CORRAL_MODEL_CACHE": str(tmp_path / "cache"),
    }
    hub.chunk_delay_s = 0.05  # the weights take ~0.7 s, so the second replica asks mid-download
    try:
        uri = "hf://org/tiny-chat"
        replicas = [EngineProcess(uri, free_port(), FLAGS, log_dir=tmp_path, env=env) for _ in range(2)]
        with replicas[0], replicas[1]:
            for engine in replicas:
                engine.wait_ready(120.0)
                chat(engine, "org/tiny-chat")
            logs = [engine.log_tail(200_000) for engine in replicas]
    finally:
        hub.chunk_delay_s = 0.0
    assert not any(HF_TOKEN in log for log in logs)
    assert hub.file_gets("model.safetensors") == 1

    # The Hub gone and no token: the complete entry loads with no network access.
    offline = {**env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "", "HF_HUB_OFFLINE": "1"}
    with start_engine("hf://org/tiny-chat", log_dir=tmp_path, env=offline, **FLAGS) as engine:
        chat(engine, "org/tiny-chat")


def test_s3_uri_serves_a_chat_completion(s3: S3Server, tmp_path: Path) -> None:
    env = {**s3.env(), "CORRAL_MODEL_CACHE": str(tmp_path / "cache")}
    with start_engine(f"s3://{BUCKET}/{PREFIX}", log_dir=tmp_path, env=env, **FLAGS) as engine:
        chat(engine, "tiny")
        log = engine.log_tail(200_000)
    assert s3.secret_access_key not in log


def test_an_unfetchable_model_exits_with_its_reason(hub: HubStandIn, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "corral_cli.main", "engine", "--model", "hf://org/absent"]
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "CORRAL_MODEL_CACHE": str(tmp_path)}
    done = subprocess.run(argv, env=_with(env), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3, done.stderr
    assert "ModelNotFound" in done.stderr and "Traceback" not in done.stderr


def _with(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}
