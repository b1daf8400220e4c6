"""Routing policies and the router's admission check, on hand-made loads."""

from __future__ import annotations

import random
import typing
from collections import Counter

import pytest
from corral_gateway.load import LoadSample
from corral_gateway.policies import (
    POLICIES,
    QUEUED_BLOCK_WEIGHT,
    STEP_WAIT_BLOCKS_PER_S,
    Candidate,
    KvAware,
    PrefixAffinity,
    make_policy,
)
from corral_gateway.prefill_ledger import PrefillLedger
from corral_gateway.registry import Registry, Replica, Saturation
from corral_gateway.router import NoReplica, Router
from corral_gateway.settings import GatewaySettings, PolicyName

SAT = Saturation(max_waiting=5, max_kv_usage_ratio=0.8)


def cand(
    url: str, running: float = 0, waiting: float = 0, kv: float = 0.0, inflight: int = 0, at_s: float = 100.0
) -> Candidate:
    replica = Replica(model="m", url=url, num_inflight=inflight)
    replica.observe(LoadSample(running, waiting, kv, at_s=at_s))
    replica.num_dispatched_since_sample = 0
    return Candidate(replica, replica.load(at_s, 2.0))


def replica(
    url: str, running: float = 0, waiting: float = 0, kv: float = 0.0, at_s: float = 100.0
) -> Replica:
    r = Replica(model="m", url=url)
    r.observe(LoadSample(running, waiting, kv, at_s=at_s))
    return r


def send(policy: PrefixAffinity, replicas: list[Replica], block_hashes: tuple[int, ...], now_s: float) -> str:
    """Pick as the router does, then dispatch to the pick as the router's callers do."""
    chosen = policy.pick([Candidate(r, r.load(now_s, 2.0)) for r in replicas], None, block_hashes).replica
    chosen.on_dispatch()
    return chosen.url


def test_round_robin_cycles_through_every_replica() -> None:
    policy = make_policy("round-robin", SAT)
    cands = [cand("http://a"), cand("http://b"), cand("http://c")]
    picks = [policy.pick(cands, None).replica.url for _ in range(6)]
    assert Counter(picks) == {"http://a": 2, "http://b": 2, "http://c": 2}


def test_least_requests_picks_fewest_in_flight() -> None:
    policy = make_policy("least-requests", SAT)
    cands = [cand("http://a", inflight=4), cand("http://b", inflight=1), cand("http://c", inflight=3)]
    assert policy.pick(cands, None).replica.url == "http://b"


def test_kv_aware_prefers_short_queue_and_free_kv() -> None:
    policy = make_policy("kv-aware", SAT)
    cands = [cand("http://a", running=4, waiting=3, kv=0.5), cand("http://b", running=4, waiting=0, kv=0.2)]
    assert policy.pick(cands, None).replica.url == "http://b"
    cands = [cand("http://a", waiting=0, kv=0.7), cand("http://b", waiting=0, kv=0.1)]
    assert policy.pick(cands, None).replica.url == "http://b"


def test_kv_aware_avoids_saturated_replica_even_if_cheaper_otherwise() -> None:
    policy = KvAware(SAT)
    # a: kv 0.85 is saturated; b has a queue but is not saturated
    cands = [cand("http://a", kv=0.85), cand("http://b", waiting=4, kv=0.1)]
    assert policy.pick(cands, None).replica.url == "http://b"


def test_kv_aware_spreads_ties() -> None:
    policy = KvAware(SAT)
    cands = [cand("http://a"), cand("http://b")]
    assert {policy.pick(cands, None).replica.url for _ in range(4)} == {"http://a", "http://b"}


def test_prefix_affinity_sends_same_prefix_to_same_replica() -> None:
    policy = PrefixAffinity(SAT)
    cands = [cand(f"http://r{i}") for i in range(4)]
    for prefix_hash in (1, 2**40, 2**63 + 5, 12345678901):
        picks = {policy.pick(cands, prefix_hash).replica.url for _ in range(5)}
        assert len(picks) == 1


def test_prefix_affinity_spreads_distinct_prefixes() -> None:
    policy = PrefixAffinity(SAT)
    cands = [cand(f"http://r{i}") for i in range(3)]
    picks = Counter(policy.pick(cands, (i * 0x9E3779B97F4A7C15) % 2**64).replica.url for i in range(300))
    assert len(picks) == 3
    assert min(picks.values()) > 30


def test_prefix_affinity_agrees_across_gateways_and_candidate_order() -> None:
    cands = [cand(f"http://r{i}") for i in range(5)]
    one, two = PrefixAffinity(SAT), PrefixAffinity(SAT)
    for h in range(0, 2**64, 2**58):
        assert one.pick(cands, h).replica.url == two.pick(list(reversed(cands)), h).replica.url


def test_prefix_affinity_consistent_when_a_replica_leaves() -> None:
    policy = PrefixAffinity(SAT)
    full = [cand(f"http://r{i}") for i in range(4)]
    hashes = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(200)]
    before = {h: policy.pick(full, h).replica.url for h in hashes}
    after = {h: policy.pick(full[:3], h).replica.url for h in hashes}
    # Only prefixes homed on the removed replica move.
    moved = [h for h in hashes if before[h] != after[h]]
    assert all(before[h] == "http://r3" for h in moved)


def test_prefix_affinity_falls_back_to_kv_aware_when_home_is_saturated() -> None:
    policy = PrefixAffinity(SAT)
    cands = [cand("http://a"), cand("http://b"), cand("http://c")]
    home = policy.pick(cands, 42).replica.url
    loaded = [cand(c.replica.url, waiting=9) if c.replica.url == home else c for c in cands]
    loaded = [
        cand(c.replica.url, running=5, kv=0.3) if c.replica.url not in (home, "http://c") else c
        for c in loaded
    ]
    picked = policy.pick(loaded, 42).replica.url
    assert picked != home
    expected = KvAware(SAT).pick([c for c in loaded if c.replica.url != home], None).replica.url
    assert picked == expected


def test_prefix_affinity_bounded_load_moves_off_overloaded_home() -> None:
    policy = PrefixAffinity(SAT, load_factor=1.25)
    cands = [cand("http://a"), cand("http://b"), cand("http://c")]
    home = policy.pick(cands, 7).replica.url
    # home runs 10 (not saturated: nothing waiting), others idle: capacity ceil(1.25*11/3)=5 < 11
    busy = [cand(c.replica.url, running=10) if c.replica.url == home else c for c in cands]
    assert policy.pick(busy, 7).replica.url != home


def test_unknown_policy_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random", SAT)
    assert set(POLICIES) == set(typing.get_args(PolicyName))  # one list of names: settings, flags, chart


def make_router(policy: str = "kv-aware", now: float = 100.0) -> Router:
    registry = Registry()
    registry.set_replicas("m", ["http://a", "http://b"])
    return Router(registry, make_policy(policy, SAT), SAT, 2.0, clock=lambda: now)


def test_router_reports_saturation_when_every_replica_is_saturated() -> None:
    router = make_router()
    router.registry.observe("http://a", LoadSample(8, 6, 0.5, at_s=99.5))
    router.registry.observe("http://b", LoadSample(8, 1, 0.9, at_s=99.5))
    assert router.route("m", None) == NoReplica(is_saturated=True)
    router.registry.observe("http://b", LoadSample(8, 1, 0.5, at_s=99.6))
    routed = router.route("m", None)
    assert isinstance(routed, Replica) and routed.url == "http://b"


def test_router_ignores_stale_samples() -> None:
    router = make_router(now=100.0)
    router.registry.observe("http://a", LoadSample(8, 60, 0.99, at_s=90.0))  # 10 s old
    router.registry.observe("http://b", LoadSample(8, 60, 0.99, at_s=90.0))
    assert isinstance(router.route("m", None), Replica)


def test_router_excludes_and_skips_ejected() -> None:
    router = make_router()
    routed = router.route("m", None, exclude=["http://a"])
    assert isinstance(routed, Replica) and routed.url == "http://b"
    for _ in range(3):
        router.registry.record_failure("http://b", now_s=100.0)
    assert router.route("m", None, exclude=["http://a"]) == NoReplica(is_saturated=False)


def test_prefix_affinity_leaves_a_queueing_home_for_a_replica_with_a_free_seat() -> None:
    policy = PrefixAffinity(SAT, load_factor=10.0)  # bounded load alone would keep the home
    cands = [cand("http://a", running=4), cand("http://b", running=4), cand("http://c", running=4)]
    home = policy.pick(cands, 11).replica.url
    queued = [cand(c.replica.url, running=4, waiting=2) if c.replica.url == home else c for c in cands]
    assert policy.pick(queued, 11).replica.url != home
    # When every replica queues, affinity holds (the prefix cache is the only difference left).
    everywhere = [cand(c.replica.url, running=4, waiting=2) for c in cands]
    assert policy.pick(everywhere, 11).replica.url == home


def test_llmd_scorer_prefers_the_replica_holding_the_longest_prefix() -> None:
    from corral_gateway.policies import LlmdScorer

    policy = LlmdScorer(SAT)
    a, b = cand("http://a"), cand("http://b")
    first = policy.pick([a, b], None, (1, 2, 3, 4))
    other = b if first is a else a
    assert policy.prefix_scores(["http://a", "http://b"], (1, 2, 9, 9))[first.replica.url] == 0.5
    for _ in range(5):  # the same document keeps its replica while loads are equal
        assert policy.pick([a, b], None, (1, 2, 3, 4, 5)) is first
    # A queue outweighs a shared prefix: 3 x 1.0 prefix < 2 x 1.0 queue + 2 x KV gap of 0.6.
    busy = cand(first.replica.url, waiting=4, kv=0.7)
    idle = cand(other.replica.url, waiting=0, kv=0.1)
    assert policy.pick([busy, idle], None, (1, 2, 3, 4)) is idle


def test_llmd_scorer_filters_saturated_replicas_and_forgets_old_blocks() -> None:
    from corral_gateway.policies import LlmdScorer

    policy = LlmdScorer(SAT, lru_blocks=4)
    home = cand("http://a")
    policy.pick([home], None, (1, 2, 3, 4))
    full = cand("http://a", waiting=9)
    free = cand("http://b", waiting=3, kv=0.5)
    assert policy.pick([full, free], None, (1, 2, 3, 4)) is free
    policy.pick([cand("http://a")], None, (5, 6, 7, 8))  # pushes 1-4 out of a's four slots
    assert policy.prefix_scores(["http://a"], (1, 2, 3, 4)) == {"http://a": 0.0}


def test_peek_chains_block_hashes_so_shared_heads_share_hashes() -> None:
    import json

    from corral_gateway.peek import peek_request

    doc = "lorem ipsum " * 40
    one = peek_request(json.dumps({"model": "m", "prompt": doc + "first?"}).encode(), 64, 4, 256)
    two = peek_request(json.dumps({"model": "m", "prompt": doc + "second!"}).encode(), 64, 4, 256)
    assert len(one.block_hashes) == len(doc + "first?") // 64
    assert one.block_hashes[:7] == two.block_hashes[:7]
    assert peek_request(json.dumps({"model": "m", "prompt": doc}).encode()).block_hashes == ()


def test_prefix_affinity_follows_the_longest_prefix_a_replica_was_sent() -> None:
    policy = PrefixAffinity(SAT)
    urls = [f"http://r{i}" for i in range(4)]
    system = (1, 2, 3)
    for i, url in enumerate(urls):  # every replica has served the shared system prompt
        policy.index.remember(url, (*system, 100 + i))
    doc = (*system, *range(1000, 1040))  # a 40-block document after it
    first = policy.pick([cand(u) for u in urls], 5, (*doc, 40))
    for question in range(41, 46):  # the document's later questions follow it, not the system prompt
        fresh = [cand(u, at_s=100.0 + question) for u in urls]  # each after a new load sample
        assert policy.pick(fresh, 5, (*doc, question)).replica.url == first.replica.url
    # ... unless the queue its replica reports holds more prefill than the document saves.
    busy = [cand(u, waiting=2, at_s=200.0) if u == first.replica.url else cand(u, at_s=200.0) for u in urls]
    assert policy.pick(busy, 5, (*doc, 50)).replica.url != first.replica.url


def test_prefix_affinity_weighs_the_prefill_a_prefix_saves_against_prefill_sent_to_its_replica() -> None:
    policy = PrefixAffinity(SAT)
    replicas = [replica(u, running=8) for u in ("http://a", "http://b", "http://c")]
    a = replicas[0]
    short, long = tuple(range(10)), tuple(range(100, 200))  # cached on a: 10 and 100 blocks
    other, again = tuple(range(300, 310)), tuple(range(400, 410))  # and two more of 10 blocks
    for prefix in (short, long, other, again):
        policy.index.remember("http://a", prefix)
    for _ in range(3):  # three 8-block prompts nothing caches, sent to a, no first byte back yet
        policy.ledger.record(a, 8, 100.0)
        a.on_dispatch()
    # a: 1 + 24 blocks to prefill before the first token, b and c: 11 -> elsewhere.
    assert send(policy, replicas, (*short, 7777), 100.0) != "http://a"
    # a: 1 + 24 against 101 -> the 100-block prefix is worth the wait.
    assert send(policy, replicas, (*long, 8888), 100.0) == "http://a"
    # A newer load sample shows them running, which does not say their prompts are computed:
    # a: 1 + 25 against 11.
    a.observe(LoadSample(12, 0, 0.0, at_s=101.0))
    assert send(policy, replicas, (*other, 9999), 101.0) != "http://a"
    # Their first bytes came back: a is back to 1 block.
    for _ in range(4):
        a.on_first_byte()
    assert send(policy, replicas, (*again, 1111), 101.0) == "http://a"


def test_prefix_affinity_counts_a_prompts_own_blocks_twice_against_prefill_already_pending() -> None:
    """Blocks a replica lacks are new work for the fleet (they delay everything behind them there);
    prefill already pending is not. So a holder with work queued keeps its document longer."""
    doc = tuple(range(100))  # a holds a 100-block document and has 120 blocks pending
    for policy, expected in (
        (PrefixAffinity(SAT), "http://a"),
        (PrefixAffinity(SAT, own_block_weight=1.0), "http://b"),
    ):
        replicas = [replica("http://a", running=4), replica("http://b", running=4)]
        policy.index.remember("http://a", doc)
        for _ in range(3):
            policy.ledger.record(replicas[0], 40, 100.0)
            replicas[0].on_dispatch()
        # x2 (default): a 2 x 1 + 120 = 122 against b 2 x 101 = 202; x1: a 121 against b 101.
        assert send(policy, replicas, (*doc, 7), 100.0) == expected


def test_prefix_affinity_spreads_prompts_nothing_caches_by_the_prefill_sent_between_samples() -> None:
    policy = PrefixAffinity(SAT)
    replicas = [replica(f"http://r{i}") for i in range(4)]  # one load sample for the whole burst
    rng = random.Random(1)
    long_prompt = tuple(rng.getrandbits(64) for _ in range(60))
    first = send(policy, replicas, long_prompt, 100.0)
    picks = Counter(
        send(policy, replicas, tuple(rng.getrandbits(64) for _ in range(5)), 100.0) for _ in range(12)
    )
    # The 60-block prompt's replica gets none of the short ones (5 blocks each, 4 per replica
    # balance out at 20 < 60), the others share them evenly.
    assert first not in picks and sorted(picks.values()) == [4, 4, 4]


def test_prefix_affinity_leaves_saturated_and_overloaded_holders() -> None:
    policy = PrefixAffinity(SAT, load_factor=1.25)
    doc = tuple(range(50))
    policy.index.remember("http://a", doc)
    assert policy.pick([cand("http://a"), cand("http://b")], None, (*doc, 1)).replica.url == "http://a"
    saturated = [cand("http://a", kv=0.9, at_s=101.0), cand("http://b", at_s=101.0)]
    assert policy.pick(saturated, None, (*doc, 2)).replica.url == "http://b"
    # Running 20 against 0: above ceil(1.25 x 21 / 2) = 14, so bounded loads move it.
    overloaded = [cand("http://a", running=20, at_s=102.0), cand("http://b", at_s=102.0)]
    assert policy.pick(overloaded, None, (*doc, 3)).replica.url == "http://b"


def test_prefill_ledger_prices_a_reported_queue_at_the_mean_request() -> None:
    ledger = PrefillLedger(smoothing=0.5)
    a, b = replica("http://a"), replica("http://b", waiting=3)
    assert ledger.pending_blocks(b, b.load(100.0, 2.0)) == 0.0  # no request seen yet
    for num_blocks in (10, 20):  # mean 10 -> 15
        ledger.record(a, num_blocks, 100.0)
        a.on_dispatch()
    assert ledger.pending_blocks(a, a.load(100.0, 2.0)) == 30.0
    assert ledger.pending_blocks(b, b.load(100.0, 2.0)) == 45.0  # another gateway's queue
    ledger.record(b, 5, 100.0)  # mean 15 -> 10; one of b's queued requests is now this gateway's
    b.on_dispatch()
    assert ledger.pending_blocks(b, b.load(100.0, 2.0)) == 5.0 + 2 * 10.0


def test_prefill_ledger_counts_a_prompt_until_its_first_byte_comes_back() -> None:
    ledger = PrefillLedger()
    a = replica("http://a")
    for num_blocks in (40, 10, 10):
        ledger.record(a, num_blocks, 100.0)
        a.on_dispatch()
    a.observe(LoadSample(3, 0, 0.1, at_s=101.0))  # all three running, the first maybe mid-prompt
    assert ledger.pending_blocks(a, a.load(101.0, 2.0)) == 60.0
    a.on_first_byte()  # the oldest prompt is computed
    assert ledger.pending_blocks(a, a.load(101.0, 2.0)) == 20.0
    a.on_done()  # it ends
    assert ledger.pending_blocks(a, a.load(101.0, 2.0)) == 20.0
    a.on_done()  # another ends without a first byte (a failure): one fewer in flight than kept
    assert ledger.pending_blocks(a, a.load(101.0, 2.0)) == 10.0


def test_prefill_ledger_tells_the_requests_sent_since_a_time_until_their_first_bytes() -> None:
    ledger = PrefillLedger()
    a = replica("http://a")
    for sent_s in (10.0, 11.0, 12.0):
        ledger.record(a, 5, sent_s)
        a.on_dispatch()
    assert [ledger.num_sent_since(a, t) for t in (9.0, 10.0, 10.5, 12.0)] == [3, 2, 2, 0]
    a.on_first_byte()  # the oldest, sent at 10.0
    assert ledger.num_sent_since(a, 9.0) == 2 and ledger.num_sent_since(a, 10.5) == 2
    a.on_first_byte()
    assert ledger.num_sent_since(a, 10.5) == 1


def test_prefix_affinity_keeps_a_long_prompt_off_a_step_that_others_wait_to_start() -> None:
    """A request sent after a replica's step in flight began starts with its next step, and so
    would a prompt sent now: the engine computes both in that step, so the one waiting there
    also waits for this prompt's blocks."""
    for weight, expected in ((1.0, "http://b"), (0.0, "http://a")):
        policy = PrefixAffinity(
            SAT, step_wait_blocks_per_s=1500.0, clock=lambda: 100.0, queued_block_weight=weight
        )
        replicas = [replica(u, running=8) for u in ("http://a", "http://b")]
        a, b = replicas
        for r, began_s in ((a, 99.985), (b, 99.990)):  # steps of 20 ms: a's ends 5 ms sooner
            for k in reversed(range(10)):
                r.step_phase.on_chunk(began_s - 0.020 * k)
        policy.ledger.record(a, 1, 99.990)  # after a's step began: not started
        policy.ledger.record(b, 1, 99.980)  # before b's step began: computing now
        for r in replicas:
            r.on_dispatch()
        # A 30-block prompt: a (2 + 1) x 30 + 1 + 1500 x 0.025 = 128.5, b 2 x 30 + 1 + 1500 x 0.030
        # = 106; without the weight, a 98.5.
        assert send(policy, replicas, tuple(range(1000, 1030)), 100.0) == expected


def test_the_gateway_settings_default_to_prefix_affinitys_own_prices() -> None:
    settings = GatewaySettings()
    assert settings.affinity_step_blocks_per_s == STEP_WAIT_BLOCKS_PER_S
    assert settings.affinity_queued_block_weight == QUEUED_BLOCK_WEIGHT


def test_prefix_affinity_spreads_new_prompts_that_share_only_a_system_prompt() -> None:
    policy = PrefixAffinity(SAT)
    urls = [f"http://r{i}" for i in range(4)]
    for url in urls:  # once every replica has served the system prompt, it no longer pulls
        policy.index.remember(url, (1, 2, 3, 99))
    rng = random.Random(0)  # block hashes are 64-bit, spread over the ring
    homes = Counter(
        policy.pick(
            [cand(u) for u in urls], 5, (1, 2, 3, rng.getrandbits(64), rng.getrandbits(64))
        ).replica.url
        for _ in range(200)
    )
    assert len(homes) == 4 and max(homes.values()) < 100


def test_ring_order_of_changing_candidate_sets_matches_a_ring_built_for_each_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from corral_gateway import policies

    rng = random.Random(3)
    urls = [f"http://r{i}" for i in range(12)]
    policy = PrefixAffinity(SAT, vnodes=8)
    builds = []
    build = policy._build_ring
    monkeypatch.setattr(policy, "_build_ring", lambda u: (builds.append(set(u)), build(u)))
    for _ in range(300):  # under load the candidates are whichever replicas have room
        subset = rng.sample(urls, rng.randrange(1, len(urls) + 1))
        key = rng.getrandbits(64)
        assert policy.ring_order(subset, key) == PrefixAffinity(SAT, vnodes=8).ring_order(subset, key)
    assert len(builds) < 10  # grown a few times, not rebuilt for every set
    # A fleet that shrank for good leaves the ring after a window of calls that never ask for the rest.
    monkeypatch.setattr(policies, "_RING_WINDOW", 50)
    for _ in range(120):
        policy.ring_order(urls[:3], rng.getrandbits(64))
    assert builds[-1] == set(urls[:3]) and policy.ring_order(urls[:3], 5) == PrefixAffinity(
        SAT, vnodes=8
    ).ring_order(urls[:3], 5)


def test_a_replica_that_leaves_takes_its_ledger_records_and_the_blocks_sent_to_it_along() -> None:
    registry = Registry()
    registry.set_replicas("m", ["http://a", "http://b"])
    registry.set_replicas("n", ["http://b"])  # another model served at b
    policy = PrefixAffinity(SAT)
    Router(registry, policy, SAT, 2.0, clock=lambda: 100.0)
    doc = tuple(range(20))
    for r in registry.all_replicas():
        policy.ledger.record(r, 20, 100.0)
        r.on_dispatch()
        policy.index.remember(r.url, doc)
    assert policy.ledger.num_replicas == 3
    registry.set_replicas("m", ["http://b"])
    assert policy.ledger.num_replicas == 2
    # A new replica at a's address holds nothing this gateway sent the old one.
    registry.set_replicas("m", ["http://a", "http://b"])
    assert policy.index.matched_blocks(["http://a", "http://b"], doc) == {"http://a": 0, "http://b": 20}
    registry.remove_model("m")
    assert policy.ledger.num_replicas == 1  # n's replica at b
    assert policy.index.matched_blocks(["http://b"], doc) == {"http://b": 20}  # n still served there
    registry.remove_model("n")
    assert policy.ledger.num_replicas == 0
    assert policy.index.matched_blocks(["http://b"], doc) == {"http://b": 0}


@pytest.mark.parametrize("ending", ["http://a", "http://b"])
def test_prefix_affinity_sends_a_prompt_to_the_replica_whose_steps_let_it_start_first(ending: str) -> None:
    policy = PrefixAffinity(SAT, step_wait_blocks_per_s=2500.0, clock=lambda: 100.0)
    replicas = [replica(u, running=8) for u in ("http://a", "http://b")]
    for r in replicas:  # steps of 20 ms; the one ending has 1 ms left at 100.0, the other 16
        left_s = 0.001 if r.url == ending else 0.016
        for k in reversed(range(10)):
            r.step_phase.on_chunk(100.0 - 0.020 + left_s - 0.020 * k)
    assert send(policy, replicas, (1, 2, 3), 100.0) == ending
    # The same phase, but the other replica's steps take half as long (a lighter batch).
    policy = PrefixAffinity(SAT, step_wait_blocks_per_s=2500.0, clock=lambda: 100.0)
    replicas = [replica(u, running=8) for u in ("http://a", "http://b")]
    for r in replicas:
        step_s = 0.010 if r.url == ending else 0.020
        for k in reversed(range(10)):
            r.step_phase.on_chunk(100.0 - step_s + 0.005 - step_s * k)
    assert send(policy, replicas, (1, 2, 3), 100.0) == ending
    # Unknown phases (no streams seen) leave the choice to the other costs.
    quiet = [replica(u, running=8) for u in ("http://a", "http://b")]
    picks = {send(PrefixAffinity(SAT, step_wait_blocks_per_s=2500.0), quiet, (k, 9), 100.0) for k in range(2)}
    assert picks == {"http://a", "http://b"}
