"""bench/gpu/served_report.py: the served phase of several acceptance runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu import served_report
from bench.gpu.acceptance import RESULT_FILE


def _run(root: Path, name: str, async_scheduling: str, ttft_p99: float, compiled: int | None) -> None:
    rate = {
        "ttft_ms": {"p50": 30.0, "p99": ttft_p99},
        "tpot_ms": {"p50": 7.0, "p99": 9.0},
        "output_throughput": 1300.0,
        "steps": {
            "mixed": {"count": 150, "mean_ms": 20.0},
            "decode": {"count": 3000, "mean_ms": 6.0},
            "double": {"count": 0, "mean_ms": 0.0},
        },
    }
    if compiled is not None:
        rate["kernel_variants_compiled"] = compiled
    served = {
        "engine": {"start_s": 14.5},
        "settings": f"overlap_output=auto, async_scheduling={async_scheduling}, triton_ops=auto",
        "rates": {"10": rate, "20": {**rate, "ttft_ms": {"p50": 40.0, "p99": 2 * ttft_p99}}},
    }
    (root / name).mkdir(parents=True)
    (root / name / RESULT_FILE).write_text(json.dumps({"phases": {"env": {}, "served": served}}))


def test_four_runs_side_by_side(tmp_path: Path) -> None:
    _run(tmp_path, "A-cold", "auto", 1800.0, 0)
    _run(tmp_path, "A-warm", "auto", 90.0, 0)
    _run(tmp_path, "B-cold", "0", 70.0, None)  # an engine from before the count
    (tmp_path / "B-warm").mkdir()  # a run cut short: no JSON
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / RESULT_FILE).write_text(json.dumps({"phases": {"env": {}}}))  # no served phase
    assert served_report.main([str(tmp_path)]) == 0
    data = json.loads((tmp_path / "served-ab.json").read_text())
    runs = ["A-cold", "A-warm", "B-cold"]
    assert [(r["run"], r["rate"]) for r in data] == [(run, rate) for run in runs for rate in (10.0, 20.0)]
    assert data[1]["ttft_p99_ms"] == 3600.0 and data[0]["async_scheduling"] == "auto"
    table = (tmp_path / "served-ab.md").read_text()
    assert "| A-cold | auto | 14.5 | 10 | 30.0 / 1800.0 |" in table
    assert table.splitlines()[-1].endswith("| - |")  # B-cold: no count
    assert (tmp_path / "served-ab.png").stat().st_size > 1000


def test_nothing_served_is_an_error(tmp_path: Path) -> None:
    assert served_report.main([str(tmp_path)]) == 1
