"""The `corral` command's own surface: --version, global options before or after the subcommand,
defaults in every --help, a missing extra named in one line, and bench's API key and headers."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import socket
import subprocess
import sys

import pytest
from corral_cli import logs
from corral_cli.cmd_bench import request_headers
from corral_cli.listen import cannot_listen
from corral_cli.main import SUBCOMMANDS, build_parser, has_shown_default, main, version

from tests.bench.fake_openai import MODEL, serve_fake


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"corral {version()}"
    assert version()[0].isdigit()


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "--log-format", "json", "gateway", "--backend", "m=http://h:1"],
        ["gateway", "--backend", "m=http://h:1", "--log-level", "debug", "--log-format", "json"],
        ["--log-level", "debug", "gateway", "--log-format", "json", "--backend", "m=http://h:1"],
    ],
)
def test_global_options_before_or_after_the_subcommand(argv: list[str]) -> None:
    args = build_parser(only="gateway").parse_args(argv)
    assert (args.log_level, args.log_format, args.command) == ("DEBUG", "json", "gateway")


def test_global_options_default_when_not_given() -> None:
    args = build_parser(only="gateway").parse_args(["gateway", "--backend", "m=http://h:1"])
    assert (args.log_level, args.log_format) == ("INFO", "text")


def test_bad_log_format_is_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser(only="gateway").parse_args(["gateway", "--log-format", "xml"])


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_default_is_shown_in_help(command: str) -> None:
    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = " ".join(sub.format_help().split())
    for action in sub._actions:
        if has_shown_default(action):
            help_text = " ".join(sub._get_formatter()._expand_help(action).split()) if action.help else ""
            assert "default" in help_text, f"{command} {action.option_strings}: {help_text!r}"
    assert "(default: INFO)" in text


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(only=command)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


@pytest.mark.parametrize(
    ("command", "flag", "shown"),
    [
        ("bench", "--seed", "(default: 0)"),
        ("bench", "--burstiness", "(default: 1.0)"),
        ("bench", "--temperature", "(default: 0.0)"),
        ("calibrate", "--seed", "(default: 0)"),
    ],
)
def test_defaults_of_zero_and_one_are_shown(command: str, flag: str, shown: str) -> None:
    # 0 == False and 1.0 == True in Python: a check by equality once hid these defaults.
    sub = _subparser(command)
    action = sub._option_string_actions[flag]
    assert has_shown_default(action)
    assert shown in " ".join(sub._get_formatter()._expand_help(action).split())


def test_engine_help_names_every_builtin_profile() -> None:
    from corral_engine.sim.perf_model import BUILTIN

    text = _subparser("engine")._option_string_actions["--simulate"].help or ""
    assert set(BUILTIN) <= set(text.replace(",", " ").replace("(", " ").split())


def test_bench_help_states_the_random_vocabulary_it_draws_from() -> None:
    from corral_cli.bench.workload import allowed_token_ids

    ids = allowed_token_ids(None, None)
    text = _subparser("bench")._option_string_actions["--random-vocab-size"].help or ""
    assert f"from {ids.min()} to below it (default: {ids.max() + 1}," in text


def test_missing_extra_is_one_line_naming_the_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    # Simulate an install without the engine extra: importing torch fails as it would.
    monkeypatch.setitem(sys.modules, "torch", None)
    (tmp_path / "config.json").write_text("{}")  # a model directory, as far as the early check sees
    assert main(["engine", "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "corral: error: corral engine needs the Python package 'torch', which is not installed: "
        "pip install 'corral[engine]'"
    ]


def test_json_log_lines_carry_the_extra_fields(capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("corral-test-json")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logs.json_formatter())
    logger.addHandler(handler)
    try:
        logger.warning("request %s done", "r1", extra={"request_id": "r1", "status": 200, "latency_s": 0.5})
        logger.warning("started", extra={"color_message": "\x1b[32mstarted\x1b[0m"})  # as uvicorn logs
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(text) for text in capsys.readouterr().out.splitlines())
    assert second["message"] == "started" and "color_message" not in second
    line = first
    assert line["message"] == "request r1 done" and line["level"] == "WARNING"
    assert (line["request_id"], line["status"], line["latency_s"]) == ("r1", 200, 0.5)
    assert line["logger"] == "corral-test-json" and line["time"].startswith("20")


def test_text_log_lines_cannot_be_forged_by_a_newline_in_what_a_client_sent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logger = logging.getLogger("corral-test-text")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logs.TextFormatter())
    logger.addHandler(handler)
    try:
        logger.warning("POST %s 404", "/v1/x\n2026-01-01 00:00:00,000 INFO forged: line\r\x1b[2J\tend")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("POST /v1/x")
    # The sent line is a continuation of the record, not one of its own (those start with the time).
    assert lines[1] == "    2026-01-01 00:00:00,000 INFO forged: line\\r\\x1b[2J\tend 404"
    assert lines[2].endswith("failed") and lines[3] == "Traceback (most recent call last):"  # kept whole


def test_bench_request_headers() -> None:
    assert request_headers("sk-1", ["x-corral-priority: 5", "X-Team:a:b"]) == {
        "Authorization": "Bearer sk-1",
        "x-corral-priority": "5",
        "X-Team": "a:b",
    }
    assert request_headers(None, []) == {}
    with pytest.raises(ValueError, match="NAME:VALUE"):
        request_headers(None, ["no-colon"])


def test_bench_sends_the_api_key_and_headers_with_every_request() -> None:
    with serve_fake() as (url, state):
        argv = ["bench", "--base-url", url, "--num-prompts", "2", "--random-input-len", "4"]
        argv += ["--random-output-len", "2", "--no-progress", "--no-metrics", "--api-key", "sk-bench"]
        argv += ["--header", "x-corral-priority: 7"]
        assert main(argv) == 0
    assert len(state.headers) == 3  # the models list, then two requests
    for headers in state.headers:
        assert headers["authorization"] == "Bearer sk-bench"
        assert headers["x-corral-priority"] == "7"
    assert state.bodies[0]["model"] == MODEL


@pytest.mark.parametrize("level", ["bogus", "10", "verbose"])
def test_a_log_level_logging_does_not_know_is_refused(level: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser(only="gateway").parse_args(["--log-level", level, "gateway"])
    assert exit_info.value.code == 2 and "--log-level" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["0", "70000", "-1", "http"])
def test_a_port_outside_1_to_65535_is_refused(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("engine", "gateway", "up"):
        with pytest.raises(SystemExit) as exit_info:
            build_parser(only=command).parse_args([command, "--port", port])
        assert exit_info.value.code == 2 and "port" in capsys.readouterr().err


def test_a_taken_port_is_said_before_anything_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert (
            cannot_listen("127.0.0.1", [port]) == f"cannot listen on 127.0.0.1:{port}: Address already in use"
        )
        # the engine says so before it loads a model (here: one that does not exist)
        argv = [
            sys.executable,
            "-m",
            "corral_cli.main",
            "engine",
            "--model",
            "/nonexistent",
            "--port",
            str(port),
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "Address already in use" in done.stderr
    assert cannot_listen("127.0.0.1", [port]) is None


def test_file_mistakes_are_one_line_errors_before_any_work(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert main(["up", "-f", str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in caplog.text
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("x")
    # the profile's folder cannot be made: said before the model is even looked for
    no_model = str(tmp_path / "no-model")
    assert main(["calibrate", "--model", no_model, "--out", str(in_the_way / "p.json")]) == 1
    assert "cannot write" in caplog.text
    assert main(["calibrate", "--model", no_model, "--out", str(tmp_path / "p.json")]) == 1
    assert "cannot load the model" in caplog.text
    # an existing folder as --out (the file would fail only after the timing), a bad dtype
    caplog.clear()
    assert main(["calibrate", "--model", no_model, "--out", str(tmp_path)]) == 1
    assert "is a directory" in caplog.text
    assert main(["calibrate", "--model", no_model, "--out", str(tmp_path / "p.json"), "--dtype", "fp8"]) == 2
    assert "dtype must be one of" in caplog.text
