"""`corral check` (the chart's helm test) against a real engine server on a fake engine: models
listed, one chat completion, and a clear failure for every way an endpoint can be unwell."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from corral_cli.main import main
from corral_engine.server import create_app

from tests.server.fake_engine import FakeEngine

MODEL = FakeEngine.served_model_name


def _serve(app: object) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def endpoint() -> Iterator[str]:
    yield from _serve(create_app(FakeEngine(), api_key="sk-check"))


def test_check_passes_against_a_serving_endpoint(endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "corral_cli.cmd_check"):
        assert main(["check", "--base-url", endpoint, "--api-key", "sk-check"]) == 0
    assert f"models: {MODEL}" in caplog.text
    assert "chat completion from fake-model: request " in caplog.text and "check passed" in caplog.text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--api-key", "wrong"], "/v1/models: HTTP 401"),
        (["--api-key", "sk-check", "--model", "other"], "'other' is not among the served models"),
        (["--api-key", "sk-check", "--max-tokens", "-1"], "/v1/chat/completions: HTTP 400"),
    ],
)
def test_check_fails_clearly(
    endpoint: str, caplog: pytest.LogCaptureFixture, flags: list[str], message: str
) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["check", "--base-url", endpoint, *flags]) == 1
    assert message in caplog.text


def test_check_fails_when_nothing_listens(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.ERROR):
        assert main(["check", "--base-url", f"http://127.0.0.1:{port}", "--timeout", "5"]) == 1
    assert f"cannot reach http://127.0.0.1:{port}" in caplog.text
