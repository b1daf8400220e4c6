"""`corral up -f` with spec.adapters: each hf:// adapter is fetched into the local model cache (here
from the tests' Hub stand-in), the engines get `--enable-lora --lora-modules NAME=DIR`, and the
gateway routes the adapter; a bad adapter stops `corral up` before any engine starts."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from corral_cli import cmd_up
from corral_cli.listen import free_ports
from corral_engine.demo_adapter import write_demo_adapter

from tests.cli.up_process import wait_for_banner
from tests.sources.hub_standin import HubStandIn, Repo

DEPLOYMENT = """\
apiVersion: corral.dev/v1alpha1
kind: LLMDeployment
metadata:
  name: tiny-lora
spec:
  model:
    name: tiny
    source:
      hostPath:
        path: {model_dir}
  adapters:
    - name: sql
      uri: {adapter_uri}
  engine:
    kind: corral
    image: ghcr.io/corral-dev/corral-engine:0.1.0
    args:
      dtype: float32
      kvCacheMemory: 64Mi
      maxLoraRank: {max_rank}
  replicas: 1
"""
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def hub(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubStandIn]:
    """The Hub stand-in serving a demo adapter (org/sql-lora) and, as a bad adapter, a model (org/tiny)."""
    adapter = write_demo_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "sql", rank=8, seed=3)
    with HubStandIn({"org/sql-lora": Repo(adapter), "org/tiny": Repo(tiny_model_dir)}) as standin:
        yield standin


def _file(tmp_path: Path, model_dir: Path, adapter_uri: str, max_rank: int = 16) -> Path:
    path = tmp_path / "llmd.yaml"
    path.write_text(DEPLOYMENT.format(model_dir=model_dir, adapter_uri=adapter_uri, max_rank=max_rank))
    return path


def _env(tmp_path: Path, hub: HubStandIn) -> dict[str, str]:
    """The Hub at the stand-in, the model cache and HOME under tmp_path; no token, no offline mode."""
    drop = ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "CORRAL_MODEL_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    cache = str(tmp_path / "cache")
    return {**env, "HOME": str(tmp_path), "HF_ENDPOINT": hub.url, "CORRAL_MODEL_CACHE": cache}


def test_the_fleet_serves_the_files_adapter(tmp_path: Path, tiny_model_dir: Path, hub: HubStandIn) -> None:
    port = free_ports("127.0.0.1", 1)[0]
    path = _file(tmp_path, tiny_model_dir, "hf://org/sql-lora")
    argv = [sys.executable, "-m", "corral_cli.main", "up", "-f", str(path), "--port", str(port)]
    argv += ["--drain-timeout", "1", "--log-dir", str(tmp_path / "logs")]
    env = _env(tmp_path, hub)
    up = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_banner(up)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(200):  # the gateway reads the replica's /v1/models every few tens of ms
            models = {m.id: m.model_extra or {} for m in client.models.list().data}
            if "sql" in models:
                break
        assert set(models) == {"tiny", "sql"} and models["sql"]["parent"] == "tiny"
        assert Path(models["sql"]["root"]).is_relative_to(tmp_path / "cache")  # fetched into the cache
        texts = {}
        for model in ("tiny", "sql"):
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
            assert reply.model == model
            texts[model] = reply.choices[0].text
        assert texts["sql"] != texts["tiny"]
        up.send_signal(signal.SIGINT)
        _, stderr = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, stderr


def _run(path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> int:
    """`corral up -f PATH` in this process, with `env`; no engine may start."""

    def no_engine(*_: object, **__: object) -> None:
        raise AssertionError("an engine was started")

    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "HF_ENDPOINT", "CORRAL_MODEL_CACHE"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setattr(cmd_up, "LocalEngine", no_engine)
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    args = parser.parse_args(["-f", str(path), "--port", str(free_ports("127.0.0.1", 1)[0])])
    args.log_level, args.log_format = "INFO", "text"
    return cmd_up.run(args)


@pytest.mark.parametrize(
    ("uri", "max_rank", "code", "says"),
    [
        ("hf://org/missing", 16, 3, "cannot fetch an adapter: ModelNotFound: adapter 'sql' of tiny-lora:"),
        ("hf://org/tiny", 16, 1, "adapter_config.json is missing"),  # a model, not an adapter
        ("hf://org/sql-lora", 4, 1, "adapter 'sql': its rank 8 is larger than --max-lora-rank 4"),
    ],
)
def test_a_bad_adapter_stops_up_before_any_engine_starts(
    uri: str,
    max_rank: int,
    code: int,
    says: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    hub: HubStandIn,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = _file(tmp_path, tiny_model_dir, uri, max_rank)
    assert _run(path, monkeypatch, _env(tmp_path, hub)) == code
    assert says in caplog.text


def test_a_pvc_adapter_has_no_local_equivalent(tmp_path: Path, tiny_model_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    args = parser.parse_args(["-f", str(_file(tmp_path, tiny_model_dir, "pvc://adapters/sql"))])
    with pytest.raises(ValueError, match=r"spec\.adapters sql: pvc://adapters/sql is on a PVC"):
        cmd_up._fleet(args)
