"""The serving commands freeze their startup heap before serving (corral_cli.heap), once."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from corral_cli import heap
from corral_cli.heap import freeze_startup_heap
from corral_cli.main import build_parser


def test_the_startup_heap_is_collected_then_frozen_once(monkeypatch: pytest.MonkeyPatch) -> None:
    collections: list[int] = []
    collect = gc.collect

    def counting(*args: Any) -> int:
        collections.append(1)
        return collect(*args)

    monkeypatch.setattr(gc, "collect", counting)
    assert gc.get_freeze_count() == 0
    freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 0 and collections == [1]
    freeze_startup_heap()  # a second server in the same process: nothing more to do
    assert collections == [1]


def test_the_gateway_command_serves_with_its_startup_heap_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral_cli import cmd_gateway
    from corral_gateway.drain import DrainingServer

    serving_frozen: list[int] = []
    monkeypatch.setattr(DrainingServer, "run", lambda *a, **k: serving_frozen.append(gc.get_freeze_count()))
    config = tmp_path / "gw.yaml"
    config.write_text("backends:\n  a: [http://127.0.0.1:9001]\n")
    assert cmd_gateway.run(build_parser(only="gateway").parse_args(["gateway", "--config", str(config)])) == 0
    assert serving_frozen and serving_frozen[0] > 0


def test_a_simulated_engine_serves_with_its_startup_heap_frozen(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral_cli import cmd_engine
    from corral_engine.server import lifecycle

    serving_frozen: list[int] = []

    def serve(*args: Any) -> None:
        serving_frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(lifecycle, "serve", serve)
    argv = ["engine", "--simulate", "h100-llama3-8b", "--model", str(tiny_model_dir), "--port", "18999"]
    assert cmd_engine.run(build_parser(only="engine").parse_args(argv)) == 0
    assert serving_frozen and serving_frozen[0] > 0


def test_serving_sets_the_thresholds_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heap.THRESHOLDS_ENV, " 700, 10 ,50")
    heap.freeze_startup_heap()
    assert gc.get_threshold() == (700, 10, 50) != heap.SERVING_THRESHOLDS


def test_serving_sets_the_default_thresholds_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(heap.THRESHOLDS_ENV, raising=False)
    gc.set_threshold(5, 5, 5)
    heap.freeze_startup_heap()
    assert gc.get_threshold() == heap.SERVING_THRESHOLDS


@pytest.mark.parametrize("text", ["fast", "700,10,10,10", "-1", "700,,10", "7e2", "7\u00b2"])
def test_a_bad_threshold_setting_is_refused_by_name(text: str) -> None:
    with pytest.raises(heap.ThresholdSettingError, match=heap.THRESHOLDS_ENV):
        heap.parse_thresholds(text)


def test_a_serving_command_with_a_bad_setting_stops_before_it_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from corral_cli import cmd_demo_model, cmd_gateway, main

    monkeypatch.setenv(heap.THRESHOLDS_ENV, "lots")
    ran: list[str] = []
    monkeypatch.setattr(cmd_gateway, "run", lambda args: ran.append("gateway") or 0)
    monkeypatch.setattr(cmd_demo_model, "run", lambda args: ran.append("demo-model") or 0)
    assert main.main(["gateway", "--config", "gw.yaml"]) == 2
    assert ran == []
    assert "corral: error: CORRAL_GC_THRESHOLDS='lots'" in capsys.readouterr().err
    assert main.main(["demo-model", "out"]) == 0  # a command that does not serve ignores it
    assert ran == ["demo-model"]
