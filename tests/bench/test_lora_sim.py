"""LoRA adapters in the simulated fleet: the adapter workload runs to its end, and LoRA affinity
keeps each adapter on fewer replicas, so their slots are loaded less often than without it."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

from corral_engine.sim.lora_cost import lora_cost
from corral_engine.sim.perf_model import BUILTIN
from corral_gateway.adapters import Affinity

from bench.routing import lora_sim
from bench.routing.des import FleetLora, FleetSim, GatewayModel, Outcome
from bench.routing.sim_workloads import AdapterMix, WorkloadSpec, build, with_adapters

PROFILE = dataclasses.replace(BUILTIN["h100-llama3-8b"], num_kv_blocks=2000)
MIX = AdapterMix(num_adapters=8, zipf_s=1.0, base_share=0.2, seed=1)


def _run(is_affinity: bool) -> tuple[FleetSim, dict[str, Outcome]]:
    requests = with_adapters(build(WorkloadSpec("sharegpt", 250, 20.0, num_replicas=4, seed=2)), MIX)
    lora = FleetLora(tuple(MIX.names()), max_loras=2, cost=lora_cost(PROFILE), is_affinity=is_affinity)
    sim = FleetSim([PROFILE] * 4, GatewayModel("prefix-affinity"), lora=lora)
    return sim, sim.run(requests)


def test_adapter_requests_name_popular_adapters_and_hash_apart_from_the_base_model() -> None:
    plain = build(WorkloadSpec("sharegpt", 300, 20.0, seed=2))
    mixed = with_adapters(build(WorkloadSpec("sharegpt", 300, 20.0, seed=2)), MIX)
    counts = Counter(r.adapter for r in mixed)
    assert 30 < counts[None] < 90  # a fifth for the base model
    assert counts["adapter-0"] > counts["adapter-7"] > 0  # Zipf
    for a, b in zip(plain, mixed, strict=True):
        assert (a.block_hashes == b.block_hashes) == (b.adapter is None)


def test_lora_affinity_loads_adapter_slots_less_often() -> None:
    with_affinity, outcomes = _run(is_affinity=True)
    without, other = _run(is_affinity=False)
    for run in (outcomes, other):
        assert len(run) == 250 and all(o.finish_s is not None for o in run.values())
    assert all(not e.has_unfinished_requests() for e in with_affinity.engines + without.engines)
    loads = sum(e.num_lora_loads_total for e in with_affinity.engines)
    loads_without = sum(e.num_lora_loads_total for e in without.engines)
    assert 0 < loads < 0.7 * loads_without
    # The router was told each adapter request's adapter, and mostly found it active somewhere.
    num_adapter_requests = sum(o.adapter is not None for o in outcomes.values())
    assert with_affinity.affinity_counts.total() == num_adapter_requests
    assert with_affinity.affinity_counts[Affinity.ACTIVE] > with_affinity.affinity_counts.total() / 2
    assert not without.affinity_counts


def test_a_cell_compares_both_arms_on_the_same_requests(tmp_path: Path) -> None:
    args = lora_sim.parse_args(["--num-requests", "60", "--num-adapters", "8", "--max-loras", "2"])
    args.profile = "h100-llama3-8b"
    cell = lora_sim.run_cell(args, 2, capacity=50.0, load=0.2)
    assert set(cell["runs"]) == {"prefix-affinity/affinity", "prefix-affinity/no-affinity"}
    for row in cell["runs"].values():
        assert row["num_done"] == 60 and row["slot_loads_s"] > 0
    assert "| 2 | 0.20 | prefix-affinity/affinity |" in lora_sim.table([cell])
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"args": {"replicas": [2]}, "cells": [cell]}))
    assert lora_sim.main(["--from-json", str(run), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "lora_sim.json").read_text())
    assert merged["cells"] == [cell] and (tmp_path / "merged" / "lora_sim.png").stat().st_size > 0
