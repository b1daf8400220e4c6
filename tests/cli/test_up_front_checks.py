"""A missing model directory or an unknown simulator profile is one clear line, said before torch
loads or an engine process starts (`fetch-model`, `engine`, `up`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from corral_cli import cmd_engine, cmd_fetch_model, cmd_up, listen
from corral_cli.main import build_parser
from corral_engine.sim.perf_model import BUILTIN

NOT_FOUND_EXIT = 3  # fetch-model's documented "not found" code (README, docs/models.md)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser(only=argv[0]).parse_args(list(argv))


def _not_a_model(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A path that is no model directory, and what the refusal says about it."""
    if kind == "missing":
        return tmp_path / "missing", "does not exist"
    if kind == "file":
        (tmp_path / "weights.bin").write_bytes(b"")
        return tmp_path / "weights.bin", "is a file"
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty", "has no config.json"


@pytest.mark.parametrize("kind", ["missing", "file", "no-config"])
def test_fetch_model_refuses_a_local_path_that_is_no_model_directory(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    path, says = _not_a_model(tmp_path, kind)
    assert cmd_fetch_model.run(_parse("fetch-model", str(path))) == NOT_FOUND_EXIT
    assert capsys.readouterr().out == ""  # no path for an init container to hand on
    [error] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert error.startswith("ModelNotFound: ") and str(path) in error and says in error


def test_fetch_model_prints_a_local_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert cmd_fetch_model.run(_parse("fetch-model", str(tmp_path))) == 0
    assert capsys.readouterr().out == f"{tmp_path}\n"


@pytest.mark.parametrize("kind", ["missing", "no-config"])
def test_engine_refuses_a_missing_model_before_loading_torch(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def torch_first(*_: object, **__: object) -> None:
        raise AssertionError("the engine went on to load torch and the model")

    # Both ask torch (the device, the threads) before the model loads.
    monkeypatch.setattr(cmd_engine, "_engine_in_own_process", torch_first)
    monkeypatch.setattr(cmd_engine, "_set_torch_threads", torch_first)
    path, says = _not_a_model(tmp_path, kind)
    port = listen.free_ports("127.0.0.1", 1)[0]
    assert cmd_engine.run(_parse("engine", "--model", str(path), "--port", str(port))) == NOT_FOUND_EXIT
    [error] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "ModelNotFound" in error and str(path) in error and says in error


def _no_engine(*_: object, **__: object) -> None:
    raise AssertionError("an engine was started")


@pytest.mark.parametrize("profile", ["h100-nope", "missing.json"])
def test_up_refuses_an_unknown_profile_before_any_engine_starts(
    profile: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cmd_up, "LocalEngine", _no_engine)
    monkeypatch.setattr(cmd_up, "DEFAULT_DEMO_DIR", tmp_path / "demo" / "demo-model")
    log_dir = tmp_path / "logs"
    args = _parse("up", "--simulate", str(tmp_path / profile) if profile.endswith(".json") else profile)
    args.log_dir = log_dir
    assert cmd_up.run(args) == 1
    [error] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "unknown profile" in error and all(name in error for name in BUILTIN)
    assert not log_dir.exists() and not (tmp_path / "demo").exists()  # nothing written for it


def test_up_refuses_a_bad_profile_file_before_any_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cmd_up, "LocalEngine", _no_engine)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"kind": "roofline"}))
    args = _parse("up", "--simulate", str(profile), "--model", str(tmp_path))
    args.log_dir = tmp_path / "logs"
    assert cmd_up.run(args) == 1
    assert "not a fitted profile" in caplog.text


def test_up_simulate_reads_only_a_tokenizer_from_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulated fleet's --model needs tokenizer.json, not a checkpoint's config.json; one with
    neither is refused before its engine starts."""
    monkeypatch.setattr(cmd_up, "LocalEngine", _no_engine)
    model = tmp_path / "tokenizer"
    model.mkdir()
    port = str(listen.free_ports("127.0.0.1", 1)[0])
    args = _parse("up", "--simulate", "h100-llama3-8b", "--model", str(model), "--port", port)
    args.log_dir = tmp_path / "logs"  # kept, not a /tmp/corral-up-* one, when the stub stops it
    assert cmd_up.run(args) == NOT_FOUND_EXIT
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(AssertionError, match="an engine was started"):
        cmd_up.run(args)
