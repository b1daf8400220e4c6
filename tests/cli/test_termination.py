"""An engine that cannot start leaves its reason in the container's termination message, which
Kubernetes shows in `kubectl describe pod` and the operator puts in the LLMDeployment's status."""

from __future__ import annotations

import pathlib

import pytest
from corral_cli import termination
from corral_cli.listen import free_ports
from corral_cli.main import main


@pytest.fixture
def message_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    path = tmp_path / "termination-log"
    path.write_text("")  # the kubelet creates it before the container starts
    monkeypatch.setenv(termination.PATH_ENV, str(path))
    return path


def test_a_missing_model_is_the_message(message_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    (port,) = free_ports("127.0.0.1", 1)
    missing = tmp_path / "no-such-model"
    assert main(["engine", "--model", str(missing), "--host", "127.0.0.1", "--port", str(port)]) != 0
    text = message_file.read_text()
    assert str(missing) in text and "\n" not in text.strip()


def test_a_bad_argument_is_the_message(message_file: pathlib.Path) -> None:
    assert main(["engine", "--model", "/m", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in message_file.read_text()


def test_nothing_is_written_where_no_supervisor_made_the_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "termination-log"
    monkeypatch.setenv(termination.PATH_ENV, str(path))
    assert main(["engine", "--model", "/m", "--max-num-seqs", "0"]) == 2
    assert not path.exists()


def test_the_message_keeps_the_end_of_a_long_reason(message_file: pathlib.Path) -> None:
    termination.write("x" * 10_000 + " the reason")
    text = message_file.read_text()
    assert len(text) == termination.MAX_BYTES and text.endswith("the reason")
