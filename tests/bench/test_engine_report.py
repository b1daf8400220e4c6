"""bench/engine/report.py's served / offline figures (issue 21: served all at once >= 0.95x the
same engine offline), from one run or from rounds that alternate which phase goes first."""

from __future__ import annotations

from typing import Any

from bench.engine import report


def _system(
    offline_w1: float, offline_w2: float, served_w1: float, served_w2: float | None
) -> dict[str, Any]:
    runs = {"W1@inf": {"output_throughput": served_w1}}
    if served_w2 is not None:
        runs["W2@inf"] = {"output_throughput": served_w2}
    return {
        "label": "Corral",
        "offline": {
            "workloads": {"W1": {"output_throughput": offline_w1}, "W2": {"output_throughput": offline_w2}}
        },
        "served": {"runs": runs},
    }


def test_one_run() -> None:
    results = {"systems": {"corral": _system(200.0, 160.0, 190.0, 144.0)}}
    table = report.served_over_offline(results)
    assert table["corral"]["W1"]["ratios"] == [0.95]
    assert abs(table["corral"]["W2"]["median"] - 0.9) < 1e-12
    text = report.markdown_served_over_offline(results)
    assert "| Corral (yes) | W1 | 0.950x |" in text and "| Corral (no) | W2 | 0.900x |" in text


def test_rounds_give_a_median_and_a_range() -> None:
    rounds = [
        {"corral": _system(200.0, 160.0, 200.0, 150.0)},
        {"corral": _system(180.0, 150.0, 190.0, None)},  # W2 served failed this round
        {"corral": _system(210.0, 170.0, 199.5, 170.0)},
    ]
    results = {"systems": rounds[-1], "rounds": rounds}
    w1, w2 = report.served_over_offline(results)["corral"].values()
    assert [round(r, 4) for r in w1["ratios"]] == [1.0, 1.0556, 0.95]
    assert w1["median"] == 1.0 and w1["min"] == 0.95 and round(w1["max"], 4) == 1.0556
    assert len(w2["ratios"]) == 2 and w2["median"] == (150 / 160 + 1.0) / 2


def test_nothing_served_has_no_section() -> None:
    results = {"systems": {"vllm": {"offline": {"workloads": {"W1": {"output_throughput": 1.0}}}}}}
    assert report.served_over_offline(results) == {}
    assert report.markdown_served_over_offline(results) == ""
