"""Where the overhead benchmark puts its processes (pure; no processes started)."""

from __future__ import annotations

import pytest

from bench.routing import overhead_bench
from bench.routing.overhead_bench import Placement, place, summarize_rounds


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("gateway-alone", Placement(engine={2, 3}, gateway={0, 1}, client={2, 3})),
        ("split", Placement(engine={2, 3}, gateway={0, 1}, client={0, 1})),
        ("shared", Placement(engine={0, 1, 2, 3}, gateway={0, 1, 2, 3}, client={0, 1, 2, 3})),
    ],
)
def test_layouts_on_four_cores(monkeypatch: pytest.MonkeyPatch, layout: str, expected: Placement) -> None:
    monkeypatch.setattr(overhead_bench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert place(layout) == expected


def test_one_core_is_shared_by_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overhead_bench.os, "sched_getaffinity", lambda pid: {5})
    assert place("gateway-alone") == Placement({5}, {5}, {5})


def test_rounds_summarize_to_the_median_ratio_and_median_added_figures() -> None:
    rounds = [
        {"throughput_ratio": r, "added_median_e2el_ms": e, "num_counted": 250.0}
        for r, e in [(0.95, 40.0), (0.99, 10.0), (0.97, 20.0)]
    ]
    summary = summarize_rounds("twin", rounds)
    assert summary["twin_throughput_ratio"] == 0.97
    assert summary["twin_throughput_ratio_q1"] <= 0.97 <= summary["twin_throughput_ratio_q3"]
    assert abs(summary["twin_throughput_ratio_mean"] - 0.97) < 1e-9
    assert summary["twin_added_median_e2el_ms"] == 20.0
    assert "twin_num_counted" not in summary
