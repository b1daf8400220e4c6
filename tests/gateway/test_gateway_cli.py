"""`corral gateway` and `corral up` argument handling (no processes started)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from corral_cli.cmd_gateway import settings_from_args
from corral_cli.cmd_up import usage_text
from corral_cli.main import build_parser


def test_gateway_flags_become_settings(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text("backends:\n  a: [http://127.0.0.1:9001]\nmax_queue_len: 3\n")
    args = build_parser(only="gateway").parse_args(
        ["gateway", "--config", str(config), "--backend", "a=http://127.0.0.1:9002", "--policy", "kv-aware"]
    )
    settings = settings_from_args(args)
    assert settings.backends == {"a": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]}
    assert (settings.policy, settings.max_queue_len, settings.port) == ("kv-aware", 3, 8000)


def test_the_kubernetes_flag_keeps_the_files_discovery_settings(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text("kubernetes:\n  namespaces: [team-a, team-b]\n  source: pods\n")
    args = build_parser(only="gateway").parse_args(["gateway", "--config", str(config), "--kubernetes"])
    discovery = settings_from_args(args).kubernetes
    assert (discovery.enabled, discovery.namespaces, discovery.source) == (True, ("team-a", "team-b"), "pods")


def test_gateway_rejects_unknown_policy() -> None:
    with pytest.raises(SystemExit):
        build_parser(only="gateway").parse_args(["gateway", "--policy", "random"])


def test_up_flags_and_banner() -> None:
    args = build_parser(only="up").parse_args(["up", "--demo", "--replicas", "3", "--port", "9000"])
    assert (args.demo, args.replicas, args.port, args.model) == (True, 3, 9000, None)
    banner = usage_text("http://127.0.0.1:9000", "demo")
    assert "curl http://127.0.0.1:9000/v1/chat/completions" in banner
    assert 'OpenAI(base_url="http://127.0.0.1:9000/v1"' in banner and 'model="demo"' in banner
    with pytest.raises(SystemExit):
        build_parser(only="up").parse_args(["up", "--demo", "--model", "x"])


def test_gateway_logs_its_effective_settings_once_without_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from corral_cli import cmd_gateway
    from corral_gateway.drain import DrainingServer

    config = tmp_path / "gw.yaml"
    config.write_text("backends:\n  a: [http://127.0.0.1:9001]\nupstream_api_key: sk-upstream-secret\n")
    monkeypatch.setattr(DrainingServer, "run", lambda *a, **k: None)
    args = build_parser(only="gateway").parse_args(["gateway", "--config", str(config)])
    with caplog.at_level("INFO", logger=cmd_gateway.logger.name):
        assert cmd_gateway.run(args) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gateway settings:")]
    assert len(lines) == 1
    assert "'max_queue_len'" in lines[0] and "'upstream_api_key': '(set)'" in lines[0]
    assert "sk-upstream-secret" not in caplog.text


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("upstream_apikey: sk-typo-secret\n", "upstream_apikey"),
        ("upstream_api_key: 981237123\n", "upstream_api_key"),
    ],
)
def test_a_settings_error_names_the_setting_but_never_echoes_its_value(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, where: str
) -> None:
    from corral_cli import cmd_gateway

    config = tmp_path / "gw.yaml"
    config.write_text("backends:\n  a: [http://127.0.0.1:9001]\n" + text)
    args = build_parser(only="gateway").parse_args(["gateway", "--config", str(config)])
    with caplog.at_level("ERROR", logger=cmd_gateway.logger.name):
        assert cmd_gateway.run(args) == 2
    assert f"invalid gateway settings: {where}: " in caplog.text
    assert "sk-typo-secret" not in caplog.text and "981237123" not in caplog.text


def test_a_gateway_whose_port_is_taken_exits_at_once() -> None:
    # Its replica refuses connections, so pollers are mid-connect when the bind fails: on Python
    # 3.11 that used to lose the pollers' cancel and hang the process (deaf to SIGTERM too).
    with socket.socket() as taken, socket.socket() as refusing:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        refusing.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port, dead = taken.getsockname()[1], refusing.getsockname()[1]
        argv = [sys.executable, "-m", "corral_cli.main", "gateway", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--backend", f"m=http://127.0.0.1:{dead}"]
        for _ in range(3):  # the race was not every time
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode != 0
            assert "address already in use" in done.stderr
