"""`corral up --demo` writes the demo model once, in a child process: the long-running gateway
process never imports torch or transformers."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from corral_cli import cmd_up


def test_the_demo_model_is_written_by_a_child_and_torch_stays_out(tmp_path: Path) -> None:
    code = (
        "import argparse, sys\n"
        "from corral_cli import cmd_up\n"
        "parser = argparse.ArgumentParser(); cmd_up.add_arguments(parser)\n"
        "model_dir, name = cmd_up._model_dir(parser.parse_args(['--demo']))\n"
        "print(model_dir, name, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # The child's progress display may come first.
    model_dir, name, has_torch, has_transformers = done.stdout.splitlines()[-1].split()
    assert Path(model_dir) == tmp_path / ".cache" / "corral" / "demo-model" and name == "demo"
    assert (Path(model_dir) / "config.json").exists() and (Path(model_dir) / "tokenizer.json").exists()
    assert (has_torch, has_transformers) == ("False", "False")


def test_a_failed_write_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def failing_run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(cmd_up, "DEFAULT_DEMO_DIR", tmp_path / "demo-model")
    monkeypatch.setattr(cmd_up.subprocess, "run", failing_run)
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    with pytest.raises(RuntimeError, match="writing the demo model"):
        cmd_up._model_dir(parser.parse_args(["--demo"]))
    (cmd,) = calls
    demo_dir = str(tmp_path / "demo-model")
    assert cmd[1:] == ["-m", "corral_cli.main", "demo-model", demo_dir, "--preset", "tiny"]


def test_simulated_replicas_get_a_demo_tokenizer_without_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def writing_run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cmd_up, "DEFAULT_DEMO_DIR", tmp_path / "demo-model")
    monkeypatch.setattr(cmd_up.subprocess, "run", writing_run)
    parser = argparse.ArgumentParser()
    cmd_up.add_arguments(parser)
    args = parser.parse_args(["--simulate", "h100-llama3-8b", "--demo-preset", "small"])
    model_dir, name = cmd_up._model_dir(args)
    # Not the weighted demo model's directory: `up --demo` would find a checkpoint with no weights.
    assert (model_dir, name) == (tmp_path / "demo-tokenizer-small", "demo")
    (cmd,) = calls
    assert cmd[3:] == ["demo-model", str(model_dir), "--preset", "small", "--no-weights"]
