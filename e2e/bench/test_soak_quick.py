"""`python -m bench.soak` for a few seconds against a real simulated fleet, and against an engine
running the tiny model, each behind a real gateway: every request kind gets what a user should
(dropped streams included; with the model, a log probability for every sampled token), the engines
end idle with every KV block free, and the figures, table and plot are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak.__main__ import main as soak_main
from bench.soak.traffic import KINDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize(("engine", "rate"), [("simulated", "12"), ("model", "8")])
def test_a_short_soak(engine: str, rate: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["--engine", engine, "--minutes", "0.25", "--rate", rate, "--sample-s", "1"]
    argv += ["--model-dir", str(tiny_model_dir)]
    assert soak_main([*argv, "--out", str(tmp_path), "--no-progress", "--seed", "3"]) == 0
    doc = json.loads((tmp_path / "soak.json").read_text())
    outcomes = doc["outcomes"]
    assert set(outcomes) == {k.name for k in KINDS}  # every kind sent at least once in 120-180 requests
    assert all(set(by_outcome) == {"ok"} for by_outcome in outcomes.values()), outcomes
    assert sum(c for by_outcome in outcomes.values() for c in by_outcome.values()) == doc["sent"]
    # the streams the clients dropped freed their blocks: nothing left running, waiting or held
    assert doc["idle_after_s"] is not None
    final = doc["final"]["engine"]
    assert (final["running"], final["waiting"], final["kv_usage"]) == (0, 0, 0)
    assert final["prefix_hit_tokens"] > 0  # the prompts that open with the shared preamble
    for name in ("engine", "gateway"):
        process = doc["processes"][name]
        assert process["num_samples"] >= 5 and process["rss_mib_start"] > 0 and process["fds_end"] > 0
    assert doc["engine_allocator"] in ("tcmalloc", "glibc")
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"
