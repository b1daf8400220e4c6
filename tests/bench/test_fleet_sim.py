"""The simulated-fleet benchmark: its workloads and its virtual-clock fleet (gateway policies in
front of simulated engines), on small fleets."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

from corral_engine.pooling import EmbedSpec, PoolerConfig
from corral_engine.sim.embedding import SimPooling
from corral_engine.sim.perf_model import BUILTIN

from bench.routing.des import MODEL, FleetSim, GatewayModel
from bench.routing.fleet_sim import merge_cells
from bench.routing.sim_workloads import SimRequest, WorkloadSpec, build, reply_of
from bench.routing.ttft_breakdown import breakdown, components
from bench.routing.ttft_floor import prefill_time_s, ttft_floors

PROFILE = dataclasses.replace(BUILTIN["h100-llama3-8b"], num_kv_blocks=2000)


def test_chat_turns_carry_the_whole_conversation_and_the_engines_replies() -> None:
    requests = build(WorkloadSpec("chat", 400, 50.0, num_replicas=4, warmup_s=10.0))
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.request_id.split("-")[0], []).append(r)
    checked = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: int(r.request_id.split("-")[1]))
        for a, b in itertools.pairwise(turns):
            if int(b.request_id.split("-")[1]) == int(a.request_id.split("-")[1]) + 1:
                head = a.prompt + reply_of(a.prompt, a.output_len)
                assert b.prompt[: len(head)] == head and b.arrival_s > a.arrival_s
                checked += 1
    assert checked > 50
    counted = [r for r in requests if r.is_counted]
    rate = len(counted) / (requests[-1].arrival_s - 10.0)
    assert 35 < rate < 65  # sessions that began before the window keep the rate steady


def test_rag_requests_share_documents_and_the_gateway_sees_their_blocks() -> None:
    requests = build(WorkloadSpec("rag", 300, 50.0, num_replicas=2))
    assert all(len(r.block_hashes) > 100 for r in requests)
    heads = {tuple(r.block_hashes[:60]) for r in requests}
    assert len(heads) < 200  # popular documents repeat (Zipf)


def _run(policy: str, workload: str = "rag", n: int = 4) -> tuple[FleetSim, dict]:
    requests = build(WorkloadSpec(workload, 600, 40.0, num_replicas=n, seed=3))
    sim = FleetSim([PROFILE] * n, GatewayModel(policy))
    return sim, sim.run(requests)


def test_every_request_finishes_with_its_timings_in_order() -> None:
    sim, outcomes = _run("round-robin", "sharegpt")
    assert len(outcomes) == 600
    for o in outcomes.values():
        assert o.first_token_s is not None and o.finish_s is not None
        assert o.arrival_s <= o.first_token_s <= o.finish_s
    assert {o.replica for o in outcomes.values()} == {0, 1, 2, 3}
    assert all(not e.has_unfinished_requests() for e in sim.engines)
    # Each first token counts as its response's first bytes, which settle prefix affinity's ledger.
    counts = Counter(o.replica for o in outcomes.values())
    assert [r.num_first_bytes for r in sim.registry.replicas("sim")] == [counts[i] for i in range(4)]


def test_prefix_aware_routing_finds_more_cached_prefixes_than_round_robin() -> None:
    def hit_rate(sim: FleetSim) -> float:
        stats = [e.stats() for e in sim.engines]
        return sum(s.num_prefix_cache_hits_total for s in stats) / sum(
            s.num_prefix_cache_queries_total for s in stats
        )

    rr = hit_rate(_run("round-robin")[0])
    assert hit_rate(_run("llm-d")[0]) > rr + 0.05


def test_chat_warmup_turns_are_sent_but_not_counted() -> None:
    requests = build(WorkloadSpec("chat", 300, 50.0, num_replicas=4, warmup_s=8.0))
    warm = [r for r in requests if not r.is_counted]
    counted = [r for r in requests if r.is_counted]
    assert warm and counted
    assert max(r.arrival_s for r in warm) < 8.0 <= min(r.arrival_s for r in counted)
    assert 200 < len(counted) < 400  # the window still holds about `num_requests` turns
    sessions_warm = {r.request_id.split("-")[0] for r in warm}
    returning = [r for r in counted if r.request_id.split("-")[0] in sessions_warm]
    assert len(returning) > len(counted) / 3  # the warm-up's turns are what these turns carry


def test_the_ttft_floor_is_below_every_simulated_ttft() -> None:
    requests = build(WorkloadSpec("chat", 120, 40.0, num_replicas=3, seed=5, warmup_s=4.0))
    floors = ttft_floors(requests, PROFILE)
    cached = [f for f in floors.values() if f.num_cached_tokens]
    assert cached and all(f.warm_s < f.cold_s for f in cached)
    for policy in ("round-robin", "prefix-affinity"):
        outcomes = FleetSim([PROFILE] * 3, GatewayModel(policy)).run(requests)
        for o in outcomes.values():
            assert o.first_token_s is not None
            assert o.first_token_s - o.arrival_s >= floors[o.request_id].warm_s - 1e-9


def test_the_floor_reuses_an_earlier_prompt_and_reply_and_computes_at_least_one_token() -> None:
    first = SimRequest("a", 0.0, list(range(3, 103)), 20)  # 100 prompt tokens, 20 reply tokens
    again = SimRequest("b", 1.0, list(range(3, 103)), 5)  # the same prompt
    follow = SimRequest("c", 2.0, first.prompt + reply_of(first.prompt, 20) + [7] * 30, 5)
    floors = ttft_floors([follow, again, first], PROFILE)
    assert floors["a"].num_cached_tokens == 0
    assert floors["b"].num_cached_tokens == 96  # (100 - 1) // 16 blocks: one token left to compute
    assert floors["c"].num_cached_tokens == 112  # prompt + 19 computed reply tokens = 119 -> 7 blocks
    assert floors["a"].warm_s == floors["a"].cold_s == prefill_time_s(PROFILE, 100, 0)


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks() -> None:
    small = dataclasses.replace(PROFILE, max_num_batched_tokens=512)
    one = prefill_time_s(small, 512, 0)
    assert prefill_time_s(small, 1024, 0) > 2 * one  # the second chunk also reads the first's KV
    assert prefill_time_s(small, 1024, 512) < prefill_time_s(small, 1024, 0)


def test_the_ttft_breakdown_adds_up_and_tracing_changes_nothing() -> None:
    requests = build(WorkloadSpec("rag", 200, 40.0, num_replicas=3, seed=4))
    floors = ttft_floors(requests, PROFILE)
    plain = FleetSim([PROFILE] * 3, GatewayModel("prefix-affinity")).run(requests)
    sim = FleetSim([PROFILE] * 3, GatewayModel("prefix-affinity"), trace=True)
    traced = sim.run(requests)
    assert sim.tracer is not None and len(sim.tracer.traces) == len(requests)
    assert {k: o.first_token_s for k, o in traced.items()} == {k: o.first_token_s for k, o in plain.items()}
    num_waited = num_batched = num_other = 0
    for o in traced.values():
        assert o.first_token_s is not None
        parts = components(
            o.arrival_s, o.first_token_s, sim.tracer.traces[o.request_id], floors[o.request_id]
        )
        # Its steps cover its whole TTFT, unless it was preempted before its first token (this
        # small cache preempts a few): then the wait to be computed again is `other`.
        assert parts["other"] > -1e-9
        num_other += parts["other"] > 1e-9
        assert min(parts[k] for k in ("gateway_queue", "step_in_flight", "engine_queue", "decodes")) > -1e-9
        assert parts["cache_loss"] > -1e-9  # no replica holds more than the floor's one cache
        num_waited += parts["step_in_flight"] > 0
        num_batched += parts["decodes"] > 0
    assert num_waited > 100 and num_batched > 100 and num_other < len(requests) / 20
    summary = breakdown(traced, sim.tracer.traces, floors)
    assert summary["tail"]["ttft_ms"] >= summary["p99_ttft_ms"] >= summary["all"]["ttft_ms"]


def test_merged_runs_keep_a_cell_per_profile() -> None:
    def run(profile: str, p99_ms: float) -> dict:
        cell = {"replicas": 16, "workload": "rag", "load": 0.85, "arrivals": "poisson"}
        return {"args": {"profile": profile}, "cells": [cell | {"policies": {"round-robin": p99_ms}}]}

    later = run("h100-llama3-8b", 3.0)
    later["cells"][0]["policies"] = {"prefix-affinity": 4.0}
    cells = merge_cells([run("h100-llama3-8b", 1.0), run("h100-llama3-8b-corral", 2.0), later])
    assert [(c["profile"], c["policies"]) for c in cells] == [
        ("h100-llama3-8b", {"round-robin": 1.0, "prefix-affinity": 4.0}),
        ("h100-llama3-8b-corral", {"round-robin": 2.0}),
    ]
    # A merged file keeps each cell's profile.
    again = merge_cells([{"cells": cells}])
    assert [c["profile"] for c in again] == ["h100-llama3-8b", "h100-llama3-8b-corral"]


def test_a_fleet_of_embedding_replicas_replays_prompt_only_traffic() -> None:
    """With `pooling`, each request ends at the step that completes its prompt: its first byte is
    its last, no earlier than its prefill alone takes, and no output token is made."""
    pooling = SimPooling(EmbedSpec(MODEL, "pooling", 4096), PoolerConfig())
    requests = [SimRequest(f"r{i}", 0.01 * i, [1000 + i] * 300, output_len=99) for i in range(40)]
    sim = FleetSim([PROFILE] * 2, GatewayModel("least-requests"), pooling=pooling)
    outcomes = sim.run(requests)
    assert len(outcomes) == 40
    for o in outcomes.values():
        assert o.first_token_s == o.finish_s and o.finish_s is not None
        assert o.finish_s - o.arrival_s >= prefill_time_s(PROFILE, 300, 0) * (1 - 1e-9)
    stats = [e.stats() for e in sim.engines]
    assert sum(s.num_generation_tokens_total for s in stats) == 0
    assert sum(s.num_prompt_tokens_total for s in stats) == 40 * 300
    assert {o.replica for o in outcomes.values()} == {0, 1}
