"""The simulated-fleet benchmark: its workloads and its virtual-clock fleet (gateway policies in
front of simulated engines), on small fleets."""

from __future__ import annotations

import dataclasses
import itertools

from corral_engine.sim.perf_model import BUILTIN

from bench.routing.des import FleetSim, GatewayModel
from bench.routing.sim_workloads import WorkloadSpec, build, reply_of

PROFILE = dataclasses.replace(BUILTIN["h100-llama3-8b"], num_kv_blocks=2000)


def test_chat_turns_carry_the_whole_conversation_and_the_engines_replies() -> None:
    requests = build(WorkloadSpec("chat", 400, 50.0, num_replicas=4))
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
    rate = len(requests) / requests[-1].arrival_s
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


def test_prefix_aware_routing_finds_more_cached_prefixes_than_round_robin() -> None:
    def hit_rate(sim: FleetSim) -> float:
        stats = [e.stats() for e in sim.engines]
        return sum(s.num_prefix_cache_hits_total for s in stats) / sum(
            s.num_prefix_cache_queries_total for s in stats
        )

    rr = hit_rate(_run("round-robin")[0])
    assert hit_rate(_run("llm-d")[0]) > rr + 0.05
