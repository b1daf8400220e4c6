"""Real engine processes and a real `corral gateway` process for the gateway's e2e tests."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.procs import HOST, EngineProcess, ManagedProcess, free_port, start_engine

MODEL = "tiny"


def start_gateway(backends: dict[str, list[str]], config_dir: Path, **settings: Any) -> ManagedProcess:
    """`corral gateway --config FILE` on a free port, ready once /ready answers (discovery done)."""
    port = free_port()
    config = config_dir / f"gateway-{port}.yaml"
    config.write_text(yaml.safe_dump({"backends": backends, **settings}))
    argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", HOST, "--port", str(port)]
    gateway = ManagedProcess(
        [*argv, "--config", str(config)], port, name="gateway", log_dir=config_dir, health_path="/ready"
    )
    gateway.wait_ready(60)
    return gateway


def restart_engine(model_dir: Path, port: int, **flags: Any) -> EngineProcess:
    engine = EngineProcess(model_dir, port, {"served_model_name": MODEL, **flags})
    engine.wait_ready()
    return engine


def replica_state(gateway: ManagedProcess) -> dict[str, dict[str, Any]]:
    data = httpx.get(gateway.url + "/corral/replicas", timeout=5).json()["models"][MODEL]
    return {r["url"]: r for r in data}


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[list[EngineProcess]]:
    with (
        start_engine(tiny_model_dir, served_model_name=MODEL) as a,
        start_engine(tiny_model_dir, served_model_name=MODEL) as b,
    ):
        yield [a, b]


@pytest.fixture(scope="module")
def gateway(
    engines: list[EngineProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    with start_gateway({MODEL: [e.url for e in engines]}, tmp_path_factory.mktemp("gateway")) as gw:
        yield gw
